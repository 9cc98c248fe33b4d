"""Typed workflows: YAML -> attrs classes, with every error reported at once."""
