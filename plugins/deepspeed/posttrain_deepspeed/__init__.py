"""posttrain-deepspeed: DeepSpeed ZeRO strategies."""
