"""Tasks: the tiny presets built locally (and their warm starts) and the prompt data a run draws
from (files or synthetic tasks)."""
