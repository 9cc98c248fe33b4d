#!/usr/bin/env bash
# The 8B rows of docs/performance.md on a 4-GPU machine: Llama-3.1-8B's shape, `long` workload,
# hybrid on 4 GPUs, each capped to an H100 80GB's 79.6 GiB (cluster.gpu_memory_gib), the
# workflow's memory defaults; decode with CUDA graphs (no compile).
#     bash benchmarks/rl_step_8b.sh fsdp2_train|megatron_train|deepspeed_train [SECONDS]
# With OUT set (the device tool's output folder), the run's log and table are written there.
set -u
trainer=$1
limit=${2:-540}
out=${OUT:-/tmp}
export PYTHONUNBUFFERED=1 BENCH_RUN_LOG=$out/$trainer.log
cd "$(dirname "$0")"
S=actor_train.strategy_args.strategy_config
R=reference.strategy_args.strategy_config
case $trainer in
megatron_train)
  layout=(--set $S.tensor_model_parallel_size=2 --set $S.use_distributed_optimizer=true
    --set $R.tensor_model_parallel_size=2) ;;
deepspeed_train) layout=(--set $S.zero_stage=3 --set $R.zero_stage=3) ;;
*) layout=() ;;
esac
timeout "$limit" python3 rl_step.py --device cuda --shape llama3.1-8b --workload long --gpus 4 \
  --steps 2 --max-tokens 8192 --set actor_infer.infer_batch_size=4 \
  --set cluster.gpu_memory_gib=79.6 --set actor_infer.strategy_args.strategy_config.decode=cuda_graph \
  --trainer "$trainer" "${layout[@]}" >"$out/$trainer.txt" 2>&1
echo "exit $?" >>"$out/$trainer.txt"
grep -v "Writing model\|it/s\]\|^\s*$" "$out/$trainer.log" | tail -8
grep -v "Writing model\|it/s\]\|^\s*$" "$out/$trainer.txt" | tail -22
