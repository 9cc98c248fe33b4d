"""Running model-written code: a local sandbox (bubblewrap plus rlimits) and a client of a
remote sandbox service (the SandboxFusion API). See docs/sandbox.md."""
