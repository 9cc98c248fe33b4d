"""7. Training: a step's updates on a trained role, and a rank's share of a batch (micro-batches,
gradient accumulation, scoring passes, the learning-rate schedule)."""
