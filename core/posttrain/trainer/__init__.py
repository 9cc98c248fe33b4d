"""The single-controller RL loop and what surrounds it (run directory, phases, export)."""
