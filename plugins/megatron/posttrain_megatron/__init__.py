"""posttrain-megatron: megatron_train and megatron_infer strategies (megatron-core + mbridge)."""
