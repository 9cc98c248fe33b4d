"""Build ``preset:tiny-qwen2-calculator`` (or ``--preset tiny-qwen2-python``) from scratch and
measure what RL starts from: the build time, the tool-call rate at temperature 1, and the
accuracy with and without a tool call.

Sampling is plain transformers ``generate`` and a hand loop: generation stops at ``</call>`` or
``<eos>``; after ``</call>`` the loop appends ``<result>VALUE</result>`` and generates on. VALUE is
the calculator's: for tiny-qwen2-python's calls (sums) it is what the python tool prints with
``echo_last_expression``, except for a malformed call, "" here and a traceback there. The
answer is the text after the last ``</result>``, or the whole response without a call.

    python benchmarks/calculator_preset.py [--prompts 256] [--samples 4] [--seed 0]
    python benchmarks/calculator_preset.py --preset tiny-qwen2-python
    python benchmarks/calculator_preset.py --prompts 4 --samples 1 --warm-start-steps 2  # smoke
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import time

# preset -> its synthetic task (posttrain.tasks.data.SYNTHETIC_TASKS)
TASKS = {"tiny-qwen2-calculator": "multi_digit_arithmetic", "tiny-qwen2-python": "long_sum"}
EXPR = re.compile(r"\d+(?:[+\-*]\d+)*")


def calculate(expr: str) -> str:
    """The calculator: digits and + - *, evaluated left to right with * first; "" if malformed."""
    if not EXPR.fullmatch(expr):
        return ""
    return str(sum(_product(term) for term in re.split(r"(?=[+-])", expr) if term))


def _product(term: str) -> int:
    sign = -1 if term.startswith("-") else 1
    value = 1
    for factor in term.lstrip("+-").split("*"):
        value *= int(factor)
    return sign * value


def generate(model, tokenizer, seqs: list[list[int]], stops: list[int], max_new: int):
    """One sampled continuation per sequence (left-padded batch), each cut after its stop."""
    import torch

    width = max(map(len, seqs))
    pads = torch.tensor([width - len(s) for s in seqs])
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(s)) + s for s in seqs])
    attention = (torch.arange(width)[None] >= pads[:, None]).long()
    out = model.generate(
        input_ids=ids,
        attention_mask=attention,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new,
        eos_token_id=stops,
        pad_token_id=tokenizer.pad_token_id,
    )
    rows = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        rows.append(row[:cut])
    return rows


def rollout(model, tokenizer, prompts: list[str]) -> list[tuple[str, str | None]]:
    """(decoded response, the call's expression or None) per prompt."""
    from posttrain.tasks.warm_start import CALL, END_CALL, END_RESULT, RESULT

    call_id, end_call_id = tokenizer.convert_tokens_to_ids([CALL, END_CALL])
    eos = tokenizer.eos_token_id
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    first = generate(model, tokenizer, prompt_ids, [eos, end_call_id], 28)
    responses, exprs, pending = list(first), [None] * len(prompts), []
    for i, resp in enumerate(first):
        if resp and resp[-1] == end_call_id and call_id in resp:
            exprs[i] = tokenizer.decode(resp[resp.index(call_id) + 1 : -1])
            result = f"{RESULT}{calculate(exprs[i])}{END_RESULT}"
            responses[i] = resp + tokenizer.encode(result, add_special_tokens=False)
            pending.append(i)
    if pending:
        seqs = [prompt_ids[i] + responses[i] for i in pending]
        for i, tail in zip(pending, generate(model, tokenizer, seqs, [eos], 8), strict=True):
            responses[i] = responses[i] + tail
    return [
        (tokenizer.decode(r, skip_special_tokens=True), e)
        for r, e in zip(responses, exprs, strict=True)
    ]


def final_answer(response: str) -> str:
    from posttrain.tasks.warm_start import END_RESULT

    return response.rsplit(END_RESULT, 1)[-1].strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=256, help="first N problems of the task")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--preset", choices=sorted(TASKS), default="tiny-qwen2-calculator")
    parser.add_argument(
        "--warm-start-steps",
        type=int,
        default=None,
        help="steps of the preset's warm start (default: the recipe's own); a few for a smoke "
        "check, which then measures an untrained model",
    )
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    import attrs

    from posttrain import ModelArgs
    from posttrain.backend import load_causal_lm, load_tokenizer
    from posttrain.config.data_sections import SyntheticData
    from posttrain.tasks.data import SYNTHETIC_TASKS
    from posttrain.tasks.presets import PRESETS
    from posttrain.tasks.warm_start import RECIPES

    recipe = str(PRESETS[args.preset].warm_start)

    if args.warm_start_steps is not None:
        # The preset's builder reads its recipe from RECIPES (a fresh cache below: nothing else
        # sees the shorter build).
        RECIPES[recipe] = attrs.evolve(RECIPES[recipe], steps=args.warm_start_steps)

    with tempfile.TemporaryDirectory() as cache:
        os.environ["POSTTRAIN_CACHE"] = cache  # a fresh build, timed
        from posttrain.tasks.presets import preset_path

        start = time.perf_counter()
        path = preset_path(f"preset:{args.preset}")
        build_s = time.perf_counter() - start
        model_args = ModelArgs(model_name_or_path=path)
        tokenizer, model = load_tokenizer(model_args), load_causal_lm(model_args)
    params = sum(p.numel() for p in model.parameters())

    task = TASKS[args.preset]
    records = SYNTHETIC_TASKS[task](SyntheticData(task=task))[: args.prompts]
    records = [r for r in records for _ in range(args.samples)]
    torch.manual_seed(args.seed)
    with torch.no_grad():
        samples = rollout(model, tokenizer, [r["prompt"] for r in records])
    calls = right_calls = right_exprs = right_direct = 0
    for record, (response, expr) in zip(records, samples, strict=True):
        right = final_answer(response) == record["answer"]
        if expr is None:
            right_direct += right
        else:
            calls += 1
            right_calls += right
            right_exprs += expr == record["prompt"].removesuffix("=")
    n = len(records)
    print(f"preset: {params / 1e3:.0f}k parameters, built in {build_s:.1f} s")
    print(f"samples: {n} ({args.prompts} prompts x {args.samples}), temperature 1")
    print(f"tool-call rate: {calls / n:.3f}")
    print(
        f"accuracy with a call: {right_calls / max(calls, 1):.3f} (call copies the prompt: "
        f"{right_exprs / max(calls, 1):.3f})"
    )
    print(f"accuracy without a call: {right_direct / max(n - calls, 1):.3f}")
    print(f"mean reward: {(right_calls + right_direct) / n:.3f}")
    shown = {True: 0, False: 0}  # a few samples with a call and a few without
    for (response, expr), record in zip(samples, records, strict=True):
        if shown[expr is None] < 4:
            shown[expr is None] += 1
            print(f"  {record['prompt']}{response}   (answer {record['answer']})")


if __name__ == "__main__":
    main()
