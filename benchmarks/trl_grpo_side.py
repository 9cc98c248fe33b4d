"""TRL's side of benchmarks/vs_trl.py: Hugging Face TRL's GRPOTrainer on the addition prompts, run
with TRL's own virtual environment (benchmarks/trl_env.sh), as a new user would write it.

    .venv-trl/bin/python benchmarks/trl_grpo_side.py --model DIR --prompts PROMPTS.jsonl \
        --out STEPS.jsonl [--steps 200] [--prompts-per-step 8] [--group-size 8] [--lr 1e-4]
    .venv-trl/bin/python benchmarks/trl_grpo_side.py --model DIR --prompts PROMPTS.jsonl \
        --out STEPS.jsonl --steps 1 --prompts-per-step 2 --group-size 2   # smoke check

It does not import posttrain. The reward is posttrain's ``exact_match`` (same semantics, copied).
Every optimizer step appends one line to --out: step, reward (mean over the step's completions),
and wall-clock (time.time()) stamps of the step's begin and end.
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
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    # Imported once the arguments are read: --help and argument errors need no TRL.
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)

    with open(args.prompts, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in records])

    completions_per_step = args.prompts_per_step * args.group_size
    config = GRPOConfig(
        output_dir=args.output_dir or os.path.join(os.path.dirname(args.out), "trl_output"),
        # One optimizer step = one generation batch of prompts_per_step x group_size completions.
        per_device_train_batch_size=completions_per_step,
        gradient_accumulation_steps=1,
        num_generations=args.group_size,
        generation_batch_size=completions_per_step,
        num_iterations=1,  # one PPO epoch
        max_steps=args.steps,
        learning_rate=args.lr,
        # TrainingArguments' default schedule is a linear decay; posttrain's is constant.
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,  # no KL term, no reference model
        epsilon=0.2,
        scale_rewards="group",  # as posttrain's norm_adv_by_std
        loss_type="dapo",  # token-mean over the batch, as posttrain's loss_agg_mode token-mean
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        # posttrain trains in fp32 without gradient checkpointing; TRL defaults to bf16 and
        # gradient checkpointing.
        bf16=False,
        gradient_checkpointing=False,
        model_init_kwargs={"dtype": "float32"},
        use_cpu=True,
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
