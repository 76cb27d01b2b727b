"""megatron-core on CPU (gloo): a Qwen3-like GPTModel gives the same numbers in every layout.

One single-process run (TP=PP=DP=1) is the reference. Every other layout loads the SAME full
weights, sharded here by hand (not by megatron), and must reproduce the reference's logits,
losses, gradients and optimizer step:
  * TP=2 vs TP=1: logits and grads
  * TP=2 + sequence parallel vs TP=1: logits and grads (after finalize_model_grads)
  * PP=2 (and TP=2 x PP=2, world 4) get_forward_backward_func vs PP=1: losses and grads
  * DP=2, megatron DDP + distributed optimizer: one step == DP=1 on the full batch, and a
    dist_checkpointing save/load of model + optimizer resumes to the uninterrupted parameters
  * the sequence-parallel gather / reduce-scatter with uneven split sizes (the MoE token dispatcher's
    at ETP > 1), forward and backward, against the sums written out
"""
from __future__ import annotations

import logging

import pytest
import torch

from megatron_grpo.testing.distributed import run_distributed

VOCAB = 128
SEQ = 16
LAYERS = 2
SEED = 1234
TOL = 1e-5
MICRO_BATCHES = 4
MICRO_BATCH = 2


# ----------------------------------------------------------------------------- model and data


def _build_gpt(tp: int, pp: int, sequence_parallel: bool = False, attention_dropout: float = 0.0):
    """A tiny Qwen3-like decoder: GQA (4 heads, 2 groups), RMSNorm, SwiGLU, qk-norm, RoPE, fp32."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_grpo.launch.mcore_compat import local_layer_spec

    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        ffn_hidden_size=96, normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False, qk_layernorm=True,
        hidden_dropout=0.0, attention_dropout=attention_dropout, init_method_std=0.05,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sequence_parallel,
    )
    model = GPTModel(
        config=config, transformer_layer_spec=local_layer_spec(qk_layernorm=True, normalization="RMSNorm"),
        vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(), position_embedding_type="rope",
        rotary_base=1000000, share_embeddings_and_output_weights=False, parallel_output=True,
    )
    return model, config


def _batch(rows: slice | None = None):
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCHES * MICRO_BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (MICRO_BATCHES * MICRO_BATCH, SEQ), generator=generator)
    if rows is not None:
        tokens, labels = tokens[rows], labels[rows]
    return tokens, labels


def _positions(batch_size: int) -> torch.Tensor:
    return torch.arange(SEQ).unsqueeze(0).expand(batch_size, SEQ)


# ----------------------------------------------------------------------------- sharding by hand


def _shard(name: str, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's slice of a full (TP=1) tensor, from megatron's layouts:
    column-parallel (vocab, qkv: per query group, so a plain chunk) split dim 0; SwiGLU fc1 is
    cat(gate, up), each half chunked; row-parallel (proj, fc2) split dim 1; norms replicated."""
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight")):
        return full.chunk(tp, dim=0)[tp_rank]
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return full.chunk(tp, dim=1)[tp_rank]
    if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
        return full
    raise AssertionError(f"no sharding rule for {name}")


def _local_tensors(full: dict, tp_rank: int, tp: int, pp_rank: int, pp: int) -> dict:
    """Full-model tensors -> this (TP, PP) rank's, renamed to the stage's local layer numbers."""
    per_stage = LAYERS // pp
    local = {}
    for name, tensor in full.items():
        if name.startswith("embedding.") and pp_rank != 0:
            continue
        if name.startswith(("output_layer.", "decoder.final_layernorm.")) and pp_rank != pp - 1:
            continue
        if name.startswith("decoder.layers."):
            layer = int(name.split(".")[2])
            if layer // per_stage != pp_rank:
                continue
            name = name.replace(f"decoder.layers.{layer}.", f"decoder.layers.{layer % per_stage}.", 1)
        local[name] = _shard(name, tensor, tp_rank, tp)
    return local


def _load_full_weights(model, full: dict) -> None:
    from megatron.core import parallel_state as ps

    local = _local_tensors(full, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                           ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size())
    params = dict(model.named_parameters())
    assert sorted(params) == sorted(local), "the hand sharding must cover exactly the model's parameters"
    with torch.no_grad():
        for name, param in params.items():
            assert param.shape == local[name].shape, (name, param.shape, local[name].shape)
            param.copy_(local[name])


def _grads(model) -> dict:
    # DDP-wrapped params keep their reduced grad in main_grad; plain modules in grad.
    return {name: (param.main_grad if hasattr(param, "main_grad") else param.grad).detach().clone()
            for name, param in model.named_parameters()}


def _assert_close(actual: dict, expected: dict, what: str) -> float:
    assert sorted(actual) == sorted(expected), what
    worst = 0.0
    for name in expected:
        diff = (actual[name] - expected[name]).abs().max().item()
        worst = max(worst, diff)
        assert diff <= TOL, f"{what}: {name} differs by {diff:.3g}"
    return worst


# ----------------------------------------------------------------------------- distributed bodies


def _init(tp=1, pp=1, sp=False):
    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel

    initialize_model_parallel(ParallelLayout(tensor=tp, pipeline=pp, sequence_parallel=sp), seed=SEED)


def _gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    parts = [torch.empty_like(logits) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def _reference(rank, world_size):
    """TP=PP=DP=1: fresh weights, plus every number the other layouts must reproduce."""
    _init()
    model, _ = _build_gpt(tp=1, pp=1)
    weights = {name: param.detach().clone() for name, param in model.named_parameters()}
    tokens, labels = _batch()
    logits = model(tokens, _positions(len(tokens)), None)
    model(tokens, _positions(len(tokens)), None, labels=labels).mean().backward()
    return {"weights": weights, "logits": logits.detach(), "grads": _grads(model),
            "schedule": _schedule_losses_and_grads(model, fresh_weights=weights)}


def _schedule_losses_and_grads(model, fresh_weights):
    """Losses and grads of one fwd+bwd pass of megatron's schedule over MICRO_BATCHES micro-batches."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    _load_full_weights(model, fresh_weights)
    model.zero_grad(set_to_none=True)
    tokens, labels = _batch()
    micro_batches = iter([(tokens[i:i + MICRO_BATCH], labels[i:i + MICRO_BATCH])
                          for i in range(0, len(tokens), MICRO_BATCH)])

    def forward_step(data_iterator, chunk):
        micro_tokens, micro_labels = next(data_iterator)
        output = chunk(micro_tokens, _positions(len(micro_tokens)), None, labels=micro_labels)

        def loss_func(per_token_loss):
            loss = per_token_loss.mean()
            return loss, {"loss": loss.detach()}
        return output, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=micro_batches, model=[model],
        num_microbatches=MICRO_BATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False)
    stage_losses = [item["loss"].item() for item in losses] if ps.is_pipeline_last_stage() else None
    return {"losses": stage_losses, "grads": _grads(model)}


def _tensor_parallel(rank, world_size, weights):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    _init(tp=2)
    model, _ = _build_gpt(tp=2, pp=1)
    _load_full_weights(model, weights)
    tokens, labels = _batch()
    logits = _gather_vocab(model(tokens, _positions(len(tokens)), None))
    model(tokens, _positions(len(tokens)), None, labels=labels).mean().backward()
    grads = _grads(model)
    for name, grad in grads.items():
        # q/k-norms act on this rank's heads only: their grads are partial sums over TP
        # (finalize_model_grads all-reduces them in training; see the sequence-parallel test).
        if "q_layernorm" in name or "k_layernorm" in name:
            dist.all_reduce(grad, group=ps.get_tensor_model_parallel_group())
    return {"logits": logits.detach(), "grads": grads}


def _sequence_parallel(rank, world_size, weights):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads

    _init(tp=2, sp=True)
    model, config = _build_gpt(tp=2, pp=1, sequence_parallel=True)
    _load_full_weights(model, weights)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model)
    tokens, labels = _batch()
    logits = _gather_vocab(ddp(tokens, _positions(len(tokens)), None))
    ddp(tokens, _positions(len(tokens)), None, labels=labels).mean().backward()
    finalize_model_grads([ddp])  # DP grad sync + TP all-reduce of the sequence-parallel norm grads
    grads = {name.removeprefix("module."): grad for name, grad in _grads(ddp).items()}
    return {"logits": logits.detach(), "grads": grads}


def _pipeline_parallel(rank, world_size, weights, tp, pp):
    from megatron.core import parallel_state as ps

    _init(tp=tp, pp=pp)
    model, _ = _build_gpt(tp=tp, pp=pp)
    result = _schedule_losses_and_grads(model, fresh_weights=weights)
    result.update(tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank())
    if tp > 1:
        import torch.distributed as dist

        for name, grad in result["grads"].items():  # partial over TP, as in _tensor_parallel
            if "q_layernorm" in name or "k_layernorm" in name:
                dist.all_reduce(grad, group=ps.get_tensor_model_parallel_group())
    return result


def _trainable(weights):
    """Model with the given weights, megatron DDP and the distributed optimizer (torch AdamW)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model, config = _build_gpt(tp=1, pp=1)
    _load_full_weights(model, weights)
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True), module=model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95,
                        clip_grad=1.0, use_distributed_optimizer=True, params_dtype=torch.float32), [ddp])
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return model, ddp, optimizer


def _data_parallel_share():
    from megatron.core import parallel_state as ps

    rows = len(_batch()[0]) // ps.get_data_parallel_world_size()
    start = ps.get_data_parallel_rank() * rows
    return _batch(slice(start, start + rows))


def _train_step(ddp, optimizer, tokens, labels):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, chunk):
        output = chunk(tokens, _positions(len(tokens)), None, labels=labels)

        def loss_func(per_token_loss):
            loss = per_token_loss.mean()
            return loss, {"loss": loss.detach()}
        return output, loss_func

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=None, model=[ddp],
                                         num_microbatches=1, seq_length=SEQ, micro_batch_size=len(tokens))
    ok, grad_norm, _ = optimizer.step()
    return ok, grad_norm, losses[0]["loss"].item()


def _params(model) -> dict:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def _optimizer_step(rank, world_size, weights):
    """One step of megatron DDP + distributed optimizer; each DP rank takes its share of the batch."""
    _init()
    model, ddp, optimizer = _trainable(weights)
    ok, grad_norm, loss = _train_step(ddp, optimizer, *_data_parallel_share())
    return {"ok": ok, "grad_norm": grad_norm, "loss": loss, "params": _params(model)}


def _resume(rank, world_size, weights, checkpoint_dir):
    """Step, save (model + distributed optimizer), step again; then a fresh model and optimizer
    load the checkpoint and take that second step: both must end with the same parameters."""
    from megatron.core import dist_checkpointing

    from megatron_grpo.launch.cpu import fix_torch_adam_step_after_load, prepare_torch_adam_for_load
    from megatron_grpo.launch.mcore_compat import optimizer_sharded_state_dict

    _init()
    batch = _data_parallel_share()
    model, ddp, optimizer = _trainable(weights)
    _train_step(ddp, optimizer, *batch)
    model_state = model.sharded_state_dict()
    dist_checkpointing.save({"model": model_state, "optimizer": optimizer_sharded_state_dict(
        optimizer, model_state, is_loading=False)}, checkpoint_dir)
    _train_step(ddp, optimizer, *batch)
    uninterrupted = _params(model)

    fresh_model, fresh_ddp, fresh_optimizer = _trainable(weights)
    prepare_torch_adam_for_load(fresh_optimizer)
    model_state = fresh_model.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": model_state, "optimizer": optimizer_sharded_state_dict(
        fresh_optimizer, model_state, is_loading=True)}, checkpoint_dir)
    fresh_model.load_state_dict(loaded["model"])
    with torch.no_grad():  # megatron copies into views of leaf params
        fresh_optimizer.load_state_dict(loaded["optimizer"])
    fix_torch_adam_step_after_load(fresh_optimizer)
    _train_step(fresh_ddp, fresh_optimizer, *batch)
    return {"uninterrupted": uninterrupted, "resumed": _params(fresh_model)}


def _dropout_is_quiet(rank, world_size):
    """With dropout inside megatron's RNG fork, the CPU layer must not log megatron's warning."""
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("megatron.core.tensor_parallel.random").addHandler(Collect())
    _init()
    model, _ = _build_gpt(tp=1, pp=1, attention_dropout=0.5)
    tokens, _ = _batch(slice(0, 2))
    first = model(tokens, _positions(2), None)
    second = model(tokens, _positions(2), None)
    return {"dropout_ran": not torch.equal(first, second), "records": records}


def _uneven_sequence_collectives(rank, world_size):
    """megatron's first-dim gather and reduce-scatter over TP with uneven split sizes, as the MoE
    all-to-all dispatcher calls them; the upstream gradient of each rank is scaled by rank + 1."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import (gather_from_sequence_parallel_region,
                                                        reduce_scatter_to_sequence_parallel_region)

    _init(tp=2, sp=True)
    group = parallel_state.get_tensor_model_parallel_group()
    sizes = [3, 5]
    local = (torch.arange(sizes[rank] * 2, dtype=torch.float32).reshape(-1, 2) + 100 * rank).requires_grad_()
    gathered = gather_from_sequence_parallel_region(local, group=group, output_split_sizes=sizes)
    weights = torch.arange(sum(sizes) * 2, dtype=torch.float32).reshape(-1, 2)
    (gathered * weights * (rank + 1)).sum().backward()
    full = (torch.arange(sum(sizes) * 2, dtype=torch.float32).reshape(-1, 2) * (rank + 1)).requires_grad_()
    scattered = reduce_scatter_to_sequence_parallel_region(full, group=group, input_split_sizes=sizes)
    (scattered * (rank + 1)).sum().backward()
    return {"gathered": gathered.detach(), "local_grad": local.grad, "scattered": scattered.detach(),
            "full_grad": full.grad}


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_reference, world_size=1, timeout=120)[0]


def test_tensor_parallel_matches_single_process(reference):
    results = run_distributed(_tensor_parallel, world_size=2, args=(reference["weights"],), timeout=120)
    for tp_rank, result in enumerate(results):
        logit_diff = (result["logits"] - reference["logits"]).abs().max().item()
        assert logit_diff <= TOL, f"TP=2 logits differ by {logit_diff:.3g}"
        expected = _local_tensors(reference["grads"], tp_rank, 2, 0, 1)
        _assert_close(result["grads"], expected, f"TP=2 rank {tp_rank} grads")


def test_sequence_parallel_matches_single_process(reference):
    results = run_distributed(_sequence_parallel, world_size=2, args=(reference["weights"],), timeout=120)
    for tp_rank, result in enumerate(results):
        logit_diff = (result["logits"] - reference["logits"]).abs().max().item()
        assert logit_diff <= TOL, f"TP=2+SP logits differ by {logit_diff:.3g}"
        expected = _local_tensors(reference["grads"], tp_rank, 2, 0, 1)
        _assert_close(result["grads"], expected, f"TP=2+SP rank {tp_rank} grads")


def _check_pipeline(reference, results, tp, pp):
    expected_losses = reference["schedule"]["losses"]
    assert len(expected_losses) == MICRO_BATCHES
    for result in results:
        if result["pp_rank"] == pp - 1:
            assert result["losses"] == pytest.approx(expected_losses, abs=TOL)
        else:
            assert result["losses"] is None
        expected = _local_tensors(reference["schedule"]["grads"], result["tp_rank"], tp, result["pp_rank"], pp)
        _assert_close(result["grads"], expected, f"TP={tp} PP={pp} rank {result['tp_rank']},{result['pp_rank']}")


def test_pipeline_parallel_schedule_matches_single_process(reference):
    results = run_distributed(_pipeline_parallel, world_size=2, args=(reference["weights"], 1, 2), timeout=120)
    _check_pipeline(reference, results, tp=1, pp=2)


def test_tensor_and_pipeline_parallel_world_four(reference):
    results = run_distributed(_pipeline_parallel, world_size=4, args=(reference["weights"], 2, 2), timeout=180)
    _check_pipeline(reference, results, tp=2, pp=2)


def test_distributed_optimizer_step_matches_full_batch(reference):
    single = run_distributed(_optimizer_step, world_size=1, args=(reference["weights"],), timeout=120)[0]
    pair = run_distributed(_optimizer_step, world_size=2, args=(reference["weights"],), timeout=120)
    assert single["ok"] and all(result["ok"] for result in pair)
    assert (pair[0]["loss"] + pair[1]["loss"]) / 2 == pytest.approx(single["loss"], abs=TOL)
    assert pair[0]["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)
    moved = max((single["params"][n] - reference["weights"][n]).abs().max().item() for n in single["params"])
    assert moved > 1e-4, "the step must actually move the parameters"
    for result in pair:
        _assert_close(result["params"], single["params"], "DP=2 params after one step")


def test_distributed_optimizer_checkpoint_resume(reference, tmp_path):
    checkpoint_dir = tmp_path / "ckpt"
    checkpoint_dir.mkdir()
    results = run_distributed(_resume, world_size=2, args=(reference["weights"], str(checkpoint_dir)), timeout=120)
    for result in results:
        _assert_close(result["resumed"], result["uninterrupted"], "resumed vs uninterrupted params")


def test_cpu_rng_warning_is_silenced():
    result = run_distributed(_dropout_is_quiet, world_size=1, timeout=120)[0]
    assert result["dropout_ran"]
    assert "CPU RNG state changed within GPU RNG context" not in result["records"]


def test_uneven_sequence_parallel_gather_and_reduce_scatter():
    sizes = [3, 5]
    results = run_distributed(_uneven_sequence_collectives, world_size=2, timeout=120)
    rows = torch.arange(sum(sizes) * 2, dtype=torch.float32).reshape(-1, 2)
    locals_ = [torch.arange(n * 2, dtype=torch.float32).reshape(-1, 2) + 100 * r for r, n in enumerate(sizes)]
    ones_by_rank = torch.cat([torch.full((n, 2), r + 1.0) for r, n in enumerate(sizes)])
    for rank, result in enumerate(results):
        assert torch.equal(result["gathered"], torch.cat(locals_))
        assert torch.equal(result["local_grad"], (3 * rows).split(sizes)[rank])  # (1 + 2) x the weights
        assert torch.equal(result["scattered"], (3 * rows).split(sizes)[rank])  # rows x 1 + rows x 2
        assert torch.equal(result["full_grad"], ones_by_rank)  # each rank's slice, scaled by its rank + 1
