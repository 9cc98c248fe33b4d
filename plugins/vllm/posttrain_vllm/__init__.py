"""vLLM rollout strategy for posttrain."""
