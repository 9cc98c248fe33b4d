"""1. Config: a workflow file read into typed sections, with every mistake reported at once (YAML
path, value, what was expected, a suggestion) before anything starts."""
