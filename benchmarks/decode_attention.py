"""One decode step's attention in hf_infer's fixed-shape decode, by kernel, in one run: grouped
SDPA (the baseline: the prompts' attention), cuDNN's fused kernel and posttrain's Triton kernel
(``decode_attention_kernel``; on a GPU only). One query per row over a window of the cache, the
rows' keys seen up to ``window - 64`` (the average query of a window: windows are rounded up to
128 slots past the latest query). Microseconds per layer (``--layers`` calls captured in one
CUDA graph on a GPU, as the decode runs them), the GB/s of the keys and values a row sees, and
the speed-up over the first mode (above 1: faster).

    python3 benchmarks/decode_attention.py --device cuda     # 1.5B's heads, 16-256 rows
    python benchmarks/decode_attention.py --rows 2 --windows 16 --heads 4 --kv-heads 2 --dim 16
                                                            # its smallest setting (CPU: sdpa)
"""

from __future__ import annotations

import argparse
import time

from common import device_name, print_table

UNSEEN_TAIL = 64  # slots of a window past the rows' last seen key


def attention(mode: str):
    from posttrain_hf_infer import static_decode

    if mode == "sdpa":
        return lambda *args: static_decode.grouped_sdpa(None, *args)[0]
    if mode == "cudnn":
        return lambda *args: static_decode.cudnn_sdpa(None, *args)[0]
    from posttrain_hf_infer import decode_attention_kernel

    return decode_attention_kernel.decode_attention_op


def microseconds_per_layer(attend, inputs, layers: int, on_gpu: bool, repeats: int = 10) -> float:
    import torch

    def fn():
        return attend(*inputs)

    fn()
    if not on_gpu:
        start = time.perf_counter()
        for _ in range(repeats * layers):
            fn()
        return (time.perf_counter() - start) / repeats / layers * 1e6
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture
        for _ in range(layers):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(layers):
            fn()
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / repeats / layers * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--windows", type=int, nargs="+", default=[128, 384, 640])
    parser.add_argument("--heads", type=int, default=12, help="default: Qwen2.5-1.5B's")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=28, help="calls per timed graph")
    parser.add_argument(
        "--modes",
        nargs="+",
        default=None,
        choices=["sdpa", "cudnn", "triton"],
        help="default: all three on cuda, sdpa on cpu",
    )
    args = parser.parse_args()
    import torch

    on_gpu = args.device == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    modes = args.modes or (["sdpa", "cudnn", "triton"] if on_gpu else ["sdpa"])
    slots = max(args.windows)
    table = []
    for rows in args.rows:
        like = {"device": args.device, "dtype": dtype}
        query = torch.randn(rows, args.heads, 1, args.dim, **like)
        key = torch.randn(rows, args.kv_heads, slots, args.dim, **like)
        value = torch.randn(rows, args.kv_heads, slots, args.dim, **like)
        for window in args.windows:
            seen = max(1, window - UNSEEN_TAIL)
            visible = torch.arange(window, device=args.device) < seen
            mask = torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)
            mask = mask.expand(rows, 1, 1, window).contiguous()
            read = 2 * rows * args.kv_heads * seen * args.dim * key.element_size()
            baseline = None
            for mode in modes:
                inputs = (query, key, value, mask, args.dim**-0.5)
                us = microseconds_per_layer(attention(mode), inputs, args.layers, on_gpu)
                baseline = baseline or us
                table.append(
                    {
                        "mode": mode,
                        "rows": rows,
                        "window": window,
                        "seen": seen,
                        "us per layer": us,
                        "KV GB/s": read / us / 1e3,
                        f"vs {modes[0]}": baseline / us,
                    }
                )
    print_table(
        table,
        f"decode attention: {args.heads} query heads on {args.kv_heads} KV heads of {args.dim} "
        f"({dtype}), one query a row, on {device_name(args.device)}",
        formats={"us per layer": ",.1f", "KV GB/s": ",.0f", f"vs {modes[0]}": ".2f"},
    )


if __name__ == "__main__":
    main()
