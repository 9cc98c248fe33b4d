"""TRL's side of benchmarks/vs_trl.py: Hugging Face TRL's GRPOTrainer on the given prompts, run
with TRL's own virtual environment (benchmarks/trl_env.sh) or any Python where TRL imports, as a
new user would write it.

    .venv-trl/bin/python benchmarks/trl_grpo_side.py --model DIR --prompts PROMPTS.jsonl \
        --out STEPS.jsonl [--steps 200] [--prompts-per-step 8] [--group-size 8] [--lr 1e-4]
    .venv-trl/bin/python benchmarks/trl_grpo_side.py --model DIR --prompts PROMPTS.jsonl \
        --out STEPS.jsonl --steps 1 --prompts-per-step 2 --group-size 2   # smoke check
    python3 benchmarks/trl_grpo_side.py --model DIR --prompts PROMPTS.jsonl --out STEPS.jsonl \
        --device cuda --bf16 --beta 0.001 --lr 1e-6 --prompts-per-step 16 --group-size 8 \
        --max-new-tokens 64 --ignore-eos --micro-batch 128       # vs_trl.py's speed mode

It does not import posttrain. The reward is posttrain's ``exact_match`` (same semantics, copied).
Every optimizer step appends one line to --out: step, reward (mean over the step's completions),
mean completion length in tokens, and wall-clock (time.time()) stamps of the step's begin and
end.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from transformers import TrainerCallback


def exact_match(completions, answer, **_):
    """posttrain's exact_match: 1.0 when the stripped completion equals the answer."""
    return [1.0 if c.strip() == str(a).strip() else 0.0 for c, a in zip(completions, answer)]


class StepRecorder(TrainerCallback):
    """One JSON line per optimizer step: its wall-clock begin/end and the logged mean reward."""

    def __init__(self, path: str):
        self.path = path
        self.begin: float | None = None
        self.end: float | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.begin = time.time()

    def on_step_end(self, args, state, control, **kwargs):
        self.end = time.time()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "reward" not in logs:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            record = {
                "step": state.global_step,
                "reward": logs["reward"],
                "length": logs.get("completions/mean_length"),
                "begin": self.begin,
                "end": self.end,
                "logged": time.time(),
            }
            f.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF directory of the warm-started model")
    parser.add_argument("--prompts", required=True, help="JSONL with 'prompt' and 'answer'")
    parser.add_argument("--out", required=True, help="JSONL written one line per step")
    parser.add_argument(
        "--output-dir", default=None, help="TRL's output_dir (default: beside --out)"
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-new-tokens", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every completion max-new-tokens long: the end-of-sequence token is suppressed "
        "until then (min_new_tokens)",
    )
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient (0: no reference)")
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="completions per forward/backward pass, gradients accumulated over the step's "
        "completions (default: all of them in one pass)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 autocast over float32 weights and optimizer state (default: float32)",
    )
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    completions_per_step = args.prompts_per_step * args.group_size
    micro_batch = args.micro_batch or completions_per_step
    if completions_per_step % micro_batch:
        parser.error(f"--micro-batch must divide the {completions_per_step} completions of a step")
    # Imported once the arguments are read: --help and argument errors need no TRL.
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)

    with open(args.prompts, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in records])

    config = GRPOConfig(
        output_dir=args.output_dir or os.path.join(os.path.dirname(args.out), "trl_output"),
        # One optimizer step = one generation batch of prompts_per_step x group_size completions,
        # generated in one call (steps_per_generation = the accumulation steps) and trained in
        # micro-batches of micro_batch.
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=completions_per_step // micro_batch,
        num_generations=args.group_size,
        generation_batch_size=completions_per_step,
        # One PPO epoch: the old policy's log-probs are the current ones, detached (no extra
        # forward pass), as posttrain's rollout log-probs on-policy.
        num_iterations=1,
        max_steps=args.steps,
        learning_rate=args.lr,
        # TrainingArguments' default schedule is a linear decay; posttrain's is constant.
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=args.beta,  # > 0: a k3 KL term in the loss, to a reference model TRL loads
        epsilon=0.2,
        scale_rewards="group",  # as posttrain's norm_adv_by_std
        loss_type="dapo",  # token-mean over the batch, as posttrain's loss_agg_mode token-mean
        max_completion_length=args.max_new_tokens,
        # min_new_tokens masks the end-of-sequence token's logit until max_new_tokens (not
        # eos_token_id=None: TRL would still cut the completion at a sampled EOS), as
        # posttrain's generating_args.ignore_eos keeps sampling past it.
        generation_kwargs={"min_new_tokens": args.max_new_tokens} if args.ignore_eos else None,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        # Float32 weights and optimizer state, as posttrain's fsdp2_train keeps them; --bf16
        # computes in bf16 autocast (posttrain: model_args.dtype bf16, its param_dtype). No
        # gradient checkpointing, as posttrain. TRL defaults to bf16 and checkpointing.
        bf16=args.bf16,
        gradient_checkpointing=False,
        model_init_kwargs={"dtype": "float32"},
        use_cpu=args.device == "cpu",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=args.seed,
    )
    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=exact_match,
        args=config,
        train_dataset=dataset,
        callbacks=[StepRecorder(args.out)],
    )
    trainer.train()


if __name__ == "__main__":
    main()
