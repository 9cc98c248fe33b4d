"""LoRA weight sync, the adapters alone (``model_args.lora.sync: adapter``) against the merged
model (``merged``): bytes per sync and seconds per sync.

Two tables:

* **bytes per sync, by shape**: each shape's model built on the meta device (no memory, no
  time: an 8B model counts in a second), wrapped with peft's LoRA at ``--rank`` on the
  default targets (every attention and MLP linear), and each sync's tensors counted as the
  trainers export them: ``merged`` sends every state-dict entry of the base model in the
  export dtype, ``adapter`` every ``lora_A`` and ``lora_B``.
* **seconds per sync** (``--time-shape``): fsdp2_train -> hf_infer syncs timed in the hybrid
  engine (in-process hand-over) and with separate processes (shared memory), once per sync
  mode, in the same run; ``bytes`` is what the transport moved.

    python benchmarks/lora_sync.py                                   # counts; tiny CPU timing
    python benchmarks/lora_sync.py --rank 16 --shapes qwen2-1.5b llama3.1-8b qwen2.5-7b
    python benchmarks/lora_sync.py --device cuda --time-shape qwen2-1.5b --dtype bf16
"""

from __future__ import annotations

import argparse
import tempfile

from common import SHAPES, build_model, model_config, print_table
from trainer_runs import role_spec
from weight_sync import time_syncs

from posttrain.config.sections import LoraArgs
from posttrain.launch.local import LocalLauncher
from posttrain.weight_sync.transport import InProcessTransport, SharedMemoryTransport

EXPORT_BYTES = 2  # bf16, the export dtype of a bf16 run
LAYOUTS = {"hybrid": InProcessTransport, "separate": SharedMemoryTransport}


def counted_bytes(shape: str, rank: int) -> dict:
    """Bytes of one sync of ``shape`` in each mode, counted on a meta-device model."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    config, model_class = model_config(shape)
    with torch.device("meta"):
        model = getattr(transformers, model_class)(config)
    lora = LoraArgs(rank=rank)
    peft_model = get_peft_model(
        model,
        LoraConfig(r=rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules)),
    )
    merged = adapter = 0
    # A tied output layer is counted under both its names, as the trainers send it.
    for name, tensor in peft_model.state_dict().items():
        if ".lora_A." in name or ".lora_B." in name:
            adapter += tensor.numel() * EXPORT_BYTES
        else:
            merged += tensor.numel() * EXPORT_BYTES
    params = sum(p.numel() for p in model.parameters())
    return {"shape": shape, "params": params, "merged": merged, "adapter": adapter}


def timed_rows(args) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # Untied embeddings: an adapter on a tied output layer cannot be merged.
        build_model(args.time_shape, f"{tmp}/model", dtype=args.dtype, tie_word_embeddings=False)
        settings = dict(
            model_dtype=args.dtype,
            device=args.device,
            threads=None if args.device == "cuda" else 1,
        )
        for layout in args.layouts:
            transport_cls = LAYOUTS[layout]
            times: dict[str, float] = {}
            for mode in ("merged", "adapter"):
                lora = LoraArgs(rank=args.rank, sync=mode)
                specs = [
                    role_spec("actor_train", "fsdp2_train", f"{tmp}/model", f"{tmp}/run",
                              lora=lora, **settings),
                    # The rollout learns from its model_args which adapters it receives
                    # (as posttrain run resolves them: none where whole weights come).
                    role_spec("actor_infer", "hf_infer", f"{tmp}/model", f"{tmp}/run",
                              lora=lora if mode == "adapter" else None, **settings),
                ]  # fmt: skip
                launcher = LocalLauncher(call_timeout_s=1200, start_timeout_s=1200)
                transport = transport_cls(bucket_bytes=512 << 20)
                try:
                    if transport_cls is InProcessTransport:
                        groups = launcher.start_processes(specs)
                    else:
                        groups = {s.role: launcher.start_group(s) for s in specs}
                    seconds, stats, _ = time_syncs(
                        transport, groups["actor_train"], groups["actor_infer"], args.repeats
                    )
                    transport.close(groups["actor_train"], groups["actor_infer"])
                finally:
                    launcher.shutdown()
                times[mode] = seconds
                rows.append(
                    {
                        "layout": layout,
                        "sync": mode,
                        "MB/sync": stats["bytes"] / 1e6,
                        "s/sync": seconds,
                        "vs merged": f"{times['merged'] / seconds:.1f}x",
                    }
                )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--shapes", nargs="+", default=["tiny"], choices=sorted(SHAPES))
    parser.add_argument("--time-shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--no-time", action="store_true", help="count bytes only")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()

    counts = [counted_bytes(shape, args.rank) for shape in args.shapes]
    print_table(
        [
            {
                "shape": c["shape"],
                "params": f"{c['params'] / 1e9:.2f}B"
                if c["params"] >= 1e8
                else f"{c['params'] / 1e6:.2f}M",
                "merged MB": c["merged"] / 1e6,
                "adapter MB": c["adapter"] / 1e6,
                "fewer bytes": f"{c['merged'] / c['adapter']:.0f}x",
            }
            for c in counts
        ],
        f"\nbytes per sync, rank {args.rank} on every attention and MLP linear, bf16 "
        "(counted on the meta-device model)",
        float_format=".1f",
        text_columns=2,
    )
    if not args.no_time:
        print_table(
            timed_rows(args),
            f"\nseconds per sync, {args.time_shape} in {args.dtype} on {args.device}, rank "
            f"{args.rank}: fsdp2_train (1 rank) -> hf_infer",
            float_format=".3f",
            formats={"s/sync": ".4f"},
            text_columns=2,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
