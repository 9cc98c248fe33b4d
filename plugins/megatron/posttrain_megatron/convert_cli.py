"""``posttrain convert``: HF <-> Megatron dist checkpoints, added to the CLI by this plugin.

    posttrain convert hf-to-megatron HF_DIR OUT_DIR --tp 2 --pp 1 --ep 1
    posttrain convert megatron-to-hf CKPT_DIR OUT_DIR --model HF_DIR

The dist checkpoint is layout-free (load it under any TP / PP / EP with
``use_dist_checkpointing: true, dist_checkpointing_path: OUT_DIR``); ``--tp/--pp/--ep`` choose the
layout the conversion itself runs in (for models too large for one device). One process per
rank, on GPUs when there are enough, else on the CPU over gloo.
"""

from __future__ import annotations

import argparse
import os
import socket
from typing import Any

from posttrain import UserError


def add_convert_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert", help="convert HF checkpoints to Megatron dist checkpoints and back"
    )
    parser.add_argument("direction", choices=["hf-to-megatron", "megatron-to-hf"])
    parser.add_argument("source", help="HF model directory, or a Megatron dist checkpoint")
    parser.add_argument("output", help="directory to write")
    parser.add_argument(
        "--model", help="HF directory with the config and tokenizer (megatron-to-hf only)"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel ranks")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.set_defaults(handler=run_convert)


def _check_args(args: argparse.Namespace) -> None:
    problems = []
    if not os.path.isdir(args.source):
        problems.append(f"source: {args.source} is not a directory")
    if args.direction == "megatron-to-hf" and not args.model:
        problems.append("--model: megatron-to-hf needs the HF directory the model came from")
    elif args.direction == "megatron-to-hf" and not os.path.isdir(args.model):
        problems.append(f"--model: {args.model} is not a directory")
    if args.direction == "hf-to-megatron" and not os.path.exists(
        os.path.join(args.source, "config.json")
    ):
        problems.append(f"source: {args.source} has no config.json (not an HF model directory)")
    for flag in ("tp", "pp", "ep"):
        if getattr(args, flag) < 1:
            problems.append(f"--{flag}: must be at least 1")
    if os.path.exists(os.path.join(args.output, "megatron")) or os.path.exists(
        os.path.join(args.output, "model.safetensors")
    ):
        problems.append(f"output: {args.output} already holds a checkpoint; choose a new directory")
    if problems:
        raise UserError("posttrain convert:\n  " + "\n  ".join(problems))


def run_convert(args: argparse.Namespace, host: object) -> int:
    import torch.multiprocessing as mp

    _check_args(args)
    world = args.tp * args.pp * args.ep
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_convert_rank, args=(world, port, vars(args)), nprocs=world, join=True)
    print(f"posttrain convert: wrote {args.output}")
    return 0


def _convert_rank(rank: int, world: int, port: int, args: dict[str, Any]) -> None:
    import torch

    from posttrain import ModelArgs, WorkerContext
    from posttrain_megatron import checkpointing, model_builder, weights
    from posttrain_megatron.config import MegatronInferConfig
    from posttrain_megatron.state import MegatronState

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    to_hf = args["direction"] == "megatron-to-hf"
    config = MegatronInferConfig(
        tensor_model_parallel_size=args["tp"],
        pipeline_model_parallel_size=args["pp"],
        expert_model_parallel_size=args["ep"],
        moe_token_dispatcher_type="alltoall" if cuda else "allgather",
        use_mbridge=not to_hf,
        use_dist_checkpointing=to_hf,
        dist_checkpointing_path=os.path.abspath(args["source"]) if to_hf else None,
    )
    model_path = args["model"] if to_hf else args["source"]
    worker = WorkerContext(
        role="convert",
        strategy_name="megatron_infer",
        config=config,
        model_args=ModelArgs(model_name_or_path=os.path.abspath(model_path), dtype=args["dtype"]),
        rank=rank,
        world_size=world,
        local_rank=rank,
        device=f"cuda:{rank}" if cuda else "cpu",
    )
    model_builder.setup_parallel(worker)
    worker.model, worker.engine_state(MegatronState).bridge = model_builder.build_models(worker)
    if to_hf:
        weights.export_hf(worker, args["output"])
    else:
        checkpointing.save_model_weights(worker.model, args["output"])
