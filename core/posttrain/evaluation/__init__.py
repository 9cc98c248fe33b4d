"""Held-out evaluation: the ``evaluation:`` section's datasets scored on the rollout role between
training steps, and ``posttrain eval`` for a checkpoint (docs/evaluation.md)."""
