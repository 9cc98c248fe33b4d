#!/usr/bin/env bash
# Make Hugging Face TRL's own virtual environment for benchmarks/vs_trl.py:
#     benchmarks/trl_env.sh [VENV]        (default: .venv-trl)
# CPU torch pinned (a constraint, so no dependency can pull a CUDA build); posttrain is not
# installed there: the TRL side gets the model directory and the prompts as files.
set -euo pipefail

VENV="${1:-.venv-trl}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"

"$PYTHON" -m venv "$VENV"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==${TORCH_VERSION}" >"$constraints"

pip=("$VENV/bin/python" -m pip)
"${pip[@]}" install --upgrade pip >/dev/null
"${pip[@]}" install -c "$constraints" "torch==${TORCH_VERSION}"
"${pip[@]}" install -c "$constraints" trl
# CUDA builds of these (pulled in by some transformers/trl extras) break imports on CPU.
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true

"$VENV/bin/python" - <<'PY'
import torch, transformers, trl
assert torch.version.cuda is None, f"CUDA torch in the TRL venv: {torch.__version__}"
print(f"TRL venv ready: trl {trl.__version__}, transformers {transformers.__version__}, "
      f"torch {torch.__version__}")
PY
