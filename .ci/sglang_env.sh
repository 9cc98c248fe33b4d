#!/usr/bin/env bash
# Build (or refresh) a virtual environment with SGLang (CPU), the SGLang plugin and its tests.
#   .ci/sglang_env.sh VENV_PATH [--editable]
# SGLang's wheel pins a CUDA torch and CUDA-only kernels, so it gets a venv of its own, built by
# a CPU recipe (plugins/sglang/README.md): CPU torch 2.13.0, SGLang's pure-Python requirements
# (.ci/sglang_cpu_requirements.py), then SGLang itself without dependencies. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${1:?usage: .ci/sglang_env.sh VENV_PATH [--editable]}"
mode="${2:-}"
sglang="sglang==0.5.23"  # the version of posttrain_sglang.plugin.TESTED_SGLANG

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
pip=("$py" -m pip install -q)
"$py" -m pip install -q --upgrade pip >/dev/null

# Pin torch first, and keep it pinned: a bare requirement pulls a multi-GB CUDA build.
constraints="$venv/torch-constraint.txt"
echo "torch==2.13.0" >"$constraints"
"${pip[@]}" "torch==2.13.0"

wheels="$venv/wheels"
mkdir -p "$wheels"
"$py" -m pip download -q --no-deps -d "$wheels" "$sglang"
wheel=$(ls "$wheels"/sglang-0.5.23-*.whl)
"$py" .ci/sglang_cpu_requirements.py "$wheel" >"$venv/sglang-cpu-requirements.txt"
"${pip[@]}" -c "$constraints" -r "$venv/sglang-cpu-requirements.txt"
"${pip[@]}" --no-deps "$wheel"

# The trainers (fsdp, megatron) too: the sync-parity tests feed SGLang from them.
local_pkgs=(./core ./plugins/hf_infer ./plugins/fsdp ./plugins/megatron ./plugins/sglang)
if [ "$mode" = "--editable" ]; then
  local_pkgs=(-e ./core -e ./plugins/hf_infer -e ./plugins/fsdp -e ./plugins/megatron -e ./plugins/sglang)
fi
"${pip[@]}" -c "$constraints" "${local_pkgs[@]}" "pytest>=8" "pytest-timeout>=2.3"

# TEST SUPPORT: SGLang imports torchvision and sgl_kernel at module level, in this process and
# in the scheduler processes it spawns; neither installs on CPU. posttrain_sglang.testing_shims
# stands in for those imports (and computes nothing); this .pth installs it in every interpreter
# of this venv, and only here.
site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "import posttrain_sglang.testing_shims as shims; shims.install()" \
  >"$site/posttrain_sglang_testing_shims.pth"

SGLANG_USE_CPU_ENGINE=1 "$py" -c "
import posttrain_fsdp, posttrain_sglang, sglang
from sglang.srt.entrypoints.engine import Engine  # the imports the shims stand in for
print('sglang', sglang.__version__)" 2>&1 | grep -v -i warn
