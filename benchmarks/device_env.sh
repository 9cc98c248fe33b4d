#!/usr/bin/env bash
# Make a GPU machine with no package index ready for the benchmarks: install the wheels brought
# in WHEELS (default .whl) into /tmp/site, and print the `export` line to source.
#
# Here (a machine with pip), once:
#     benchmarks/device_env.sh --download      # engines and helpers into .whl (about 20 MB)
#     benchmarks/device_env.sh --build         # posttrain and its plugins, as committed (HEAD),
#                                              # into .whl/posttrain
# There:
#     eval "$(bash benchmarks/device_env.sh)"
# Only the packages the machine lacks are installed from .whl/opt (its torch, transformers
# and the like stay as they are); posttrain, its plugins, megatron-core, mbridge, DeepSpeed,
# cattrs, pluggy and TRL always are.
set -euo pipefail
WHEELS="${WHEELS:-.whl}"
SITE=/tmp/site
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64)
fetch=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
  --implementation cp "${PLATFORMS[@]}")

case "${1:-}" in
--download)
  "${fetch[@]}" -d "$WHEELS" megatron-core==0.19.2 mbridge==0.15.1 cattrs pluggy trl==1.16.0 \
    datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19 hjson py-cpuinfo einops msgpack ninja
  # DeepSpeed is a source distribution: a wheel without prebuilt ops (torch's AdamW is used).
  DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps -w "$WHEELS" deepspeed==0.19.8
  # Installed there only where missing (name=module).
  "${fetch[@]}" -d "$WHEELS/opt" rich markdown-it-py mdurl pygments pydantic pydantic-core \
    annotated-types typing-inspection pyyaml psutil tensorboard tensorboard-data-server
  exit 0
  ;;
--build)
  # From HEAD, not the work tree: what is measured is what a commit holds.
  rm -rf "$WHEELS/posttrain"
  src=$(mktemp -d)
  git archive HEAD | tar -x -C "$src"
  out=$(realpath -m "$WHEELS/posttrain")
  (cd "$src" && python3 -m pip wheel -q --no-deps --no-build-isolation -w "$out" ./core \
    ./plugins/hf_infer ./plugins/fsdp ./plugins/megatron ./plugins/deepspeed)
  rm -rf "$src"
  exit 0
  ;;
esac

# On the GPU machine.
optional=()
for pair in rich:rich markdown_it_py:markdown_it mdurl:mdurl pygments:pygments \
  pydantic:pydantic pydantic_core:pydantic_core annotated_types:annotated_types \
  typing_inspection:typing_inspection pyyaml:yaml psutil:psutil tensorboard:tensorboard \
  tensorboard_data_server:tensorboard_data_server; do
  wheel=${pair%%:*} module=${pair##*:}
  if ! python3 -c "import $module" 2>/dev/null; then
    optional+=("$WHEELS"/opt/"$wheel"-*.whl)
  fi
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" "$WHEELS"/*.whl "$WHEELS"/posttrain/*.whl "${optional[@]}" >&2
echo "export PYTHONPATH=$SITE PATH=$SITE/bin:\$PATH"
