"""5. Scoring: the trainer-side forward passes over a rolled-out batch (old-policy and reference
log-probs, critic values) and the per-token math they share."""
