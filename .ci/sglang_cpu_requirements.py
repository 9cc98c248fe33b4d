"""Print SGLang's runtime requirements that install on a CPU-only machine (one per line).

    python .ci/sglang_cpu_requirements.py sglang-0.5.23-*.whl > requirements.txt

SGLang's wheel requires a CUDA torch and CUDA-only kernels; its pure-Python requirements are
what the CPU engine needs. The ones left out, and why:
"""

from __future__ import annotations

import re
import sys
import zipfile

# name pattern -> why it is left out
LEFT_OUT = {
    r"torch": "pinned to a CUDA build (torch==2.14.1); the CPU build 2.13.0 is installed instead",
    r"torch[-_]memory[-_]saver": "CUDA-only (release/resume memory on GPUs)",
    r"torchvision|torchaudio|torchcodec": "CUDA builds; break on CPU-only machines",
    r"timm": "requires torchvision (multimodal models only)",
    r"flashinfer.*|flash[-_]attn.*": "CUDA kernels",
    r"sglang[-_]kernel|sgl[-_].*": "CUDA kernels (sgl_kernel's names are shimmed for tests)",
    r"nvidia[-_].*|nvshmem.*|cuda[-_]python": "CUDA libraries",
    r"quack[-_]kernels|tilelang|humming[-_]kernels": "GPU kernel compilers",
}


def runtime_requirements(wheel: str) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(name).decode()
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.removeprefix("Requires-Dist:").strip()
        if "extra ==" in req:
            continue
        project = re.match(r"[A-Za-z0-9._-]+", req).group(0)
        if any(re.fullmatch(p, project, re.IGNORECASE) for p in LEFT_OUT):
            continue
        out.append(req)
    return out


if __name__ == "__main__":
    print("\n".join(runtime_requirements(sys.argv[1])))
