"""The baseline rows of benchmarks/megatron_train.py, with no plugin code: a plain megatron-core
loop (``megatron_local``) and a plain transformers loop (``transformers``) on the same shape."""

from __future__ import annotations

from megatron_rows import hf_config, random_tokens, shape_config, time_shapes


def init_dist(dev) -> None:
    import torch
    import torch.distributed as dist

    if dev.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")


def row_megatron_local(args, dev, emit) -> None:
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    init_dist(dev)
    cpu = dev.type == "cpu"
    if cpu:  # CPU check of this script only: megatron-core hard-codes CUDA (test support)
        from posttrain_megatron import cpu_support

        cpu_support.apply()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(0)
    shape = shape_config(args.shape)
    config = TransformerConfig(
        num_layers=shape["num_hidden_layers"],
        hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"],
        num_query_groups=shape["num_key_value_heads"],
        ffn_hidden_size=shape["intermediate_size"],
        kv_channels=shape["hidden_size"] // shape["num_attention_heads"],
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        add_bias_linear=False,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        # Fusions that need TransformerEngine / apex / compiled extensions: off, as in the plugin.
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=cpu,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=shape["vocab_size"],
        max_sequence_length=shape["max_position_embeddings"],
        position_embedding_type="rope",
        rotary_base=1_000_000,
        share_embeddings_and_output_weights=True,
    )
    params = sum(p.numel() for p in model.parameters())
    if not cpu:
        model.cuda(torch.cuda.current_device())
    model = Float16Module(config, model)
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-5,
            min_lr=0.0,
            weight_decay=0.0,
            clip_grad=1.0,
            bf16=True,
            params_dtype=torch.bfloat16,
        ),
        [model],
    )
    config.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()

    def make_step(rows: int, seq: int):
        ids = random_tokens(rows, seq, shape["vocab_size"]).to(dev)
        labels = torch.roll(ids, -1, dims=1)
        positions = torch.arange(seq, device=dev).unsqueeze(0).expand_as(ids)

        def loss_func(output):
            mean = output.float().mean()
            return mean, {"lm loss": mean.detach()}

        def forward_step(data_iterator, model):
            # labels given: the model returns the per-token cross entropy [b, s]
            return model(ids, positions, None, labels=labels), loss_func

        def step():
            model.zero_grad_buffer()
            optimizer.zero_grad()
            losses = forward_backward(
                forward_step_func=forward_step,
                data_iterator=iter([None]),
                model=model,
                num_microbatches=1,
                seq_length=seq,
                micro_batch_size=rows,
                forward_only=False,
            )
            _, grad_norm, _ = optimizer.step()
            last.update(loss=float(losses[0]["lm loss"]), grad_norm=float(grad_norm))

        return step

    last: dict = {}
    time_shapes(
        args, dev, emit, "megatron_local", make_step, "local", params, lambda: last.get("grad_norm")
    )
    ps.destroy_model_parallel()


def row_transformers(args, dev, emit) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(
            hf_config(args.shape), attn_implementation="sdpa", dtype=torch.bfloat16
        )
    model.train()
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=True)

    def make_step(rows: int, seq: int):
        ids = random_tokens(rows, seq, shape_config(args.shape)["vocab_size"]).to(dev)

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            last["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    last: dict = {}
    time_shapes(
        args, dev, emit, "transformers", make_step, "sdpa", params, lambda: float(last["grad_norm"])
    )
