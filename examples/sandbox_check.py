"""What a program in the sandbox can see and do; run it with
    posttrain sandbox run examples/sandbox_check.py
and compare with the guarantees `posttrain doctor` lists (docs/sandbox.md)."""

import os
import socket

print("uid", os.getuid(), "pid", os.getpid(), "cwd", os.getcwd())
print("root holds", sorted(os.listdir("/")))
print("environment", sorted(os.environ))
try:
    socket.create_connection(("1.1.1.1", 53), timeout=2).close()
    print("network: reachable")
except OSError as exc:
    print("network: unreachable", type(exc).__name__)
for path in ("/etc/passwd", os.path.expanduser("~root/.bashrc")):
    print(path, "readable" if os.access(path, os.R_OK) else "not readable")
