"""Training throughput of ``megatron_train`` on one GPU against two baselines, same shape, same run:

* ``megatron_train``: the plugin's own path: the HF config saved to a temp dir (config only:
  random init), ``engine.setup_parallel`` + ``engine.load_model`` (mbridge model from the plugin's
  layer spec, SDPA core attention + torch fused norms without TransformerEngine, megatron DDP and
  the Float16 optimizer: bf16 params, fp32 main params and grads, Adam), steps through
  ``engine.train_step`` with core's ``PolicyLoss`` (next-token log-probs and entropy from the
  logits in one pass, Triton kernels of ``token_scores``), then the time to export every weight
  in 512 MiB buckets (``weights.export_weights``: gathered HF-named tensors copied to host
  memory);
* ``megatron_local``: a plain megatron-core loop, no plugin code: ``GPTModel`` with
  ``get_gpt_layer_local_spec`` (unfused attention), Float16Module + DDP (fp32 grads), megatron's
  optimizer (same settings), ``get_forward_backward_func`` with the model's own cross entropy;
* ``transformers``: ``Qwen2ForCausalLM`` (``attn_implementation="sdpa"``) in bf16,
  ``torch.optim.AdamW(fused=True)`` on the bf16 parameters, HF's causal-LM loss, grad clipping.
* ``megatron_packing``: ``megatron_train`` on one micro-batch of rows of uneven length (8 rows,
  lengths uniform in [256, 2048]), right-padded and with ``pack_sequences`` (real tokens / s).

Every row clips gradients to norm 1.0 (as megatron_train's default ``max_grad_norm``). Tokens are
random, sequences full length (no padding). Each row runs in its own process (memory isolation).

    python benchmarks/megatron_train.py                     # Qwen2-1.5B shape, 2x4096 and 4x2048
    python benchmarks/megatron_train.py --tiny              # a tiny shape; runs on CPU in seconds
    python benchmarks/megatron_train.py --rows megatron_train,transformers --steps 5

FLOPs per token = 6 * N + 6 * L * h * s, with N the model's parameters (the tied embedding
counted once: it is the output layer's matmul; the lookup costs nothing), L layers, h the
attention width (heads x head_dim), s the sequence length: 6 * N for the forward and backward
matmuls, 6 * L * h * s for causal attention (QK^T and AV, 4 * s * h per token and layer
forward, halved by the causal mask, times 3 for forward + backward). TFLOP/s = tokens/step x
FLOPs per token / seconds per step; MFU = TFLOP/s / 989 (dense bf16 peak of an H100 / H200 SXM).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import time

from common import device_name, flops_per_token, peak_bf16_tflops, print_table
from megatron_baselines import row_megatron_local, row_transformers
from megatron_rows import (
    BATCHES,
    EXPORT_BUCKET_BYTES,
    MAX_POSITIONS,
    hf_config,
    row_megatron_packing,
    row_megatron_train,
)

ROW_FUNCS = {
    "megatron_train": row_megatron_train,
    "megatron_local": row_megatron_local,
    "transformers": row_transformers,
    "megatron_packing": row_megatron_packing,
}
ROWS = tuple(ROW_FUNCS)


def param_count(shape: str) -> int:
    """Parameters of the HF model (tied embedding once), counted on the meta device."""
    import torch
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(hf_config(shape))
    return sum(p.numel() for p in model.parameters())


def child(args) -> int:
    """One row, in this process (started by :func:`run_row`)."""
    import torch

    dev = torch.device(args.device)
    if dev.type == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    def emit(**result):
        print("RESULT " + json.dumps({"row": args.child, **result}), flush=True)

    ROW_FUNCS[args.child](args, dev, emit)
    gc.collect()
    return 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_row(row: str, args) -> tuple[list[dict], str]:
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        PYTHONUNBUFFERED="1",
    )
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        row,
        "--shape",
        args.shape,
        "--device",
        args.device,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
    ]
    if args.profile_dir:
        cmd += ["--profile-dir", args.profile_dir]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    results = [
        json.loads(line[len("RESULT ") :])
        for line in proc.stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    note = f"{row}: exit {proc.returncode} in {time.perf_counter() - start:.0f} s"
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        note += "\n" + tail
    return results, note


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated: " + ",".join(ROWS))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per shape")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (CPU check)")
    parser.add_argument("--shape", default=None, choices=sorted(MAX_POSITIONS))
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"])
    parser.add_argument("--profile-dir", default=None, help="write one profiled step per row")
    parser.add_argument("--child", default=None, choices=ROWS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.shape is None:
        args.shape = "tiny" if args.tiny else "qwen2-1.5b"
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.profile_dir:
        os.makedirs(args.profile_dir, exist_ok=True)
    if args.child:
        return child(args)

    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = set(rows) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows: {sorted(unknown)}")
    import torch

    name = device_name(args.device)
    params = param_count(args.shape)
    print(
        f"megatron_train benchmark: {args.shape} ({params / 1e9:.3f}B params, tied embedding), "
        f"bf16, 1 x {name}; torch {torch.__version__}; {args.warmup} warm-up + {args.steps} "
        f"timed steps per shape",
        flush=True,
    )
    results: list[dict] = []
    failed = False
    for row in rows:
        got, note = run_row(row, args)
        print(note, flush=True)
        failed |= "exit 0 " not in note
        results += got
    report(args, name, params, results)
    return 1 if failed else 0


def report(args, name: str, params: int, results: list[dict]) -> None:
    """The training table, the export and packing figures, and how they were computed."""
    peak = peak_bf16_tflops(name)
    train = [r for r in results if not r.get("export") and not r.get("packing")]
    base = {(r["rows"], r["seq"]): r for r in train if r["row"] == "transformers"}
    table = []
    for rows_, seq in BATCHES[args.shape]:
        for r in train:
            if (r["rows"], r["seq"]) != (rows_, seq):
                continue
            tps = rows_ * seq / r["seconds"]
            tflops = tps * flops_per_token(args.shape, params, seq) / 1e12
            ref = base.get((rows_, seq))
            table.append(
                {
                    "row": r["row"],
                    "attention": r["backend"],
                    "tokens/step": f"{rows_}x{seq}",
                    "s/step": f"{r['seconds']:.3f}",
                    "tokens/s": f"{tps:.0f}",
                    "TFLOP/s": f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.2g}",
                    "MFU": f"{100 * tflops / peak:.1f}%" if peak else "n/a",
                    "peak GiB": f"{r['peak']:.1f}",
                    "vs transformers": f"{ref['seconds'] / r['seconds']:.2f}x" if ref else "n/a",
                    "grad norm": f"{r['grad_norm']:.3g}"
                    if r.get("grad_norm") is not None
                    else "n/a",
                }
            )
    print()
    print_table(table, text_columns=2)
    ours = {(r["rows"], r["seq"]): r for r in train if r["row"] == "megatron_train"}
    ratios = [base[k]["seconds"] / ours[k]["seconds"] for k in ours if k in base]
    if ratios:
        verdict = "met" if min(ratios) >= 1.0 else "NOT met"
        print(
            f"\nmegatron_train / transformers throughput >= 1.0: {verdict} "
            f"({', '.join(f'{x:.2f}x' for x in ratios)})"
        )
    for r in train:
        if r["params"] != params:
            print(f"note: {r['row']} built {r['params']} parameters (HF count {params})")
    for r in results:
        if r.get("export"):
            first, best = r["seconds"][0], min(r["seconds"])
            print(
                f"\nexport_weights ({EXPORT_BUCKET_BYTES >> 20} MiB buckets): {r['tensors']} "
                f"tensors, {r['buckets']} buckets, {r['nbytes'] / 1e9:.2f} GB in {best:.2f} s = "
                f"{r['nbytes'] / 1e9 / best:.2f} GB/s (first pass {first:.2f} s = "
                f"{r['nbytes'] / 1e9 / first:.2f} GB/s)"
            )
    packing = {r["packed"]: r for r in results if r.get("packing")}
    if len(packing) == 2:
        first = packing[False]
        print(
            f"\npack_sequences ({first['rows']} rows of uneven length, longest {first['width']}: "
            f"{first['tokens']} real tokens, {first['rows'] * first['width']} padded):"
        )
        for packed, r in sorted(packing.items()):
            print(
                f"  {'packed' if packed else 'padded'}: {r['seconds']:.3f} s/step, "
                f"{r['tokens'] / r['seconds']:.0f} real tokens/s, peak {r['peak']:.1f} GiB"
                + (f", {first['seconds'] / r['seconds']:.2f}x" if packed else "")
            )
    print(
        f"\nFLOPs/token = 6 x {params} + 6 x layers x hidden x seq (causal attention); MFU "
        f"against {peak or 'n/a'} TFLOP/s dense bf16; 'vs transformers' = its s/step / this "
        f"row's s/step."
    )


if __name__ == "__main__":
    sys.exit(main())
