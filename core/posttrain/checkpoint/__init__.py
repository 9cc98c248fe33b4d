"""The run directory's checkpoints: atomic writes, manifests with checksums, resume lookup."""
