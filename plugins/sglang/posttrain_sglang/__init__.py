"""posttrain-sglang: SGLang rollout strategy for posttrain."""
