"""9. Checkpoints: atomic saves with manifests and workflow records, background writes, resume,
and ``posttrain export-hf``."""
