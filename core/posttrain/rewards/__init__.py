"""4. Rewards: rule-based functions (in the driver or in a pool of worker processes), the reward
model's scores, and the phase that combines them per sample."""
