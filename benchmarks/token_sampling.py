"""One decode step's token draw in hf_infer, by path, in one run: the general path
(``token_sampling.draw``: log-softmax, softmax, multinomial), the compiled Gumbel-max
(``gumbel_choice`` under ``torch.compile`` reading uniforms ``torch.rand`` wrote first: the
compiled decode's draw off a GPU) and, on a GPU, the Triton Gumbel-max kernel
(``gumbel_kernel.gumbel_max``: uniforms drawn in registers), which the compiled decode uses there.
Plain sampling (temperature 1), random logits of the model's dtype; microseconds per draw (after
warm-up calls, which include the compile), the GB/s of logits read, and the speed-up over the
first mode given (above 1: faster).

    python3 benchmarks/token_sampling.py --device cuda                 # 256 and 512 rows x 151936
    python benchmarks/token_sampling.py --rows 4 --vocab 1000 --modes general   # smallest setting
"""

from __future__ import annotations

import argparse
import time

from common import device_name, print_table


def drawer(mode: str, device: str):
    import torch

    from posttrain.protocol import SamplingParams
    from posttrain_hf_infer import token_sampling

    generator = torch.Generator(device=device).manual_seed(0)
    if mode == "general":
        sampling = SamplingParams()
        return lambda logits: token_sampling.draw(logits, sampling, generator)
    if mode == "gumbel_compiled":
        choice = torch.compile(token_sampling.gumbel_choice, fullgraph=True)

        def compiled(logits):
            uniform = torch.rand(logits.shape, generator=generator, device=device)
            return choice(logits, uniform, 1.0)

        return compiled
    from posttrain_hf_infer.gumbel_kernel import gumbel_max

    return lambda logits: gumbel_max(logits, 1.0, generator)


def microseconds(fn, logits, calls: int) -> float:
    import torch

    for _ in range(3):
        fn(logits)
    if logits.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn(logits)
    if logits.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--vocab", type=int, default=151_936, help="Qwen2's vocabulary")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument(
        "--modes",
        nargs="+",
        default=None,
        choices=["general", "gumbel_compiled", "gumbel_triton"],
        help="default: all three on cuda, general and gumbel_compiled on cpu",
    )
    args = parser.parse_args()
    import torch

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    modes = args.modes or (
        ["general", "gumbel_compiled", "gumbel_triton"]
        if args.device == "cuda"
        else ["general", "gumbel_compiled"]
    )
    table = []
    for rows in args.rows:
        logits = (torch.randn(rows, args.vocab, device=args.device) * 3).to(dtype)
        baseline = None
        for mode in modes:
            us = microseconds(drawer(mode, args.device), logits, args.calls)
            baseline = baseline or us
            table.append(
                {
                    "mode": mode,
                    "rows": rows,
                    "us per draw": us,
                    "logits GB/s": logits.numel() * logits.element_size() / us / 1e3,
                    f"vs {modes[0]}": baseline / us,
                }
            )
    print_table(
        table,
        f"hf_infer's token draw: {args.vocab} logits a row ({dtype}), temperature 1, on "
        f"{device_name(args.device)}",
        formats={"us per draw": ",.1f", "logits GB/s": ",.1f", f"vs {modes[0]}": ".2f"},
    )


if __name__ == "__main__":
    main()
