"""One pass of megatron's forward_backward_func over micro-batches: the GRPO update, or a
forward-only log-prob pass (old / reference log-probs).

Log-probs come from the last pipeline stage's TP-sharded logits through ops.vocab_parallel, so the
full vocabulary is never gathered. Loss scaling (global denominators) is documented in
algo/aggregation.py: each micro-batch back-propagates its share of the mini-batch loss times
GlobalBatchInfo.backward_scale, which cancels both DDP's gradient averaging and megatron's
division of a 2-tuple loss by num_microbatches / cp_size.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from megatron_grpo.algo import GlobalBatchInfo, GRPOLossConfig, compute_grpo_loss, staleness_gap_sums
from megatron_grpo.algo.off_policy import SAFETY_BOUND
from megatron_grpo.models.moe_metrics import RouterStats
from megatron_grpo.ops.support_logprobs import check_supports, vocab_parallel_support_logprobs_and_entropy
from megatron_grpo.ops.vocab_parallel import default_chunk_size, flatten_ignored, vocab_parallel_logprobs_and_entropy
from megatron_grpo.trainer.batches.batching import MicroBatch, TrainSample
from megatron_grpo.trainer.step.mismatch import MismatchHealth

# Metrics reduced with MAX instead of SUM over micro-batches and ranks.
MAX_METRICS = ("actor/ratio_max_abs_dev", "actor/logprob_abs_diff_max", "off_policy/is_ratio_max")
_GAP_SUM, _GAP_COUNT = "off_policy/gap_sum/", "off_policy/gap_count/"


@dataclass(frozen=True)
class StepGeometry:
    """What megatron's schedule needs to know about the micro-batches of one call."""

    seq_length: int  # full sequence (megatron divides by CP, and by TP under sequence parallelism)
    micro_batch_size: int


def _geometry(micro_batches: list[MicroBatch]) -> StepGeometry:
    # Micro-batches may differ in shape; megatron only uses these for PP p2p buffer shapes, so
    # PP runs give every micro-batch one shape (micro_batches.plan).
    first = micro_batches[0]
    if first.packed is not None:
        return StepGeometry(seq_length=first.packed.total_length, micro_batch_size=1)
    return StepGeometry(seq_length=first.processed_tokens // first.tokens.shape[0],
                        micro_batch_size=first.tokens.shape[0])


def _forward_step(loss_func, data_iterator, model):
    from megatron_grpo.models.routing_replay import set_micro_batch_routes

    micro_batch: MicroBatch = next(data_iterator)
    set_micro_batch_routes(model, micro_batch.routed_experts)  # MoE routing replay; None: own top-k
    if micro_batch.packed is None:
        output = model(micro_batch.tokens, micro_batch.position_ids, None)
    else:
        from megatron.core import parallel_state

        params = micro_batch.packed.packed_seq_params(parallel_state.get_context_parallel_world_size())
        output = model(micro_batch.tokens, micro_batch.position_ids, None, packed_seq_params=params)
    return output, partial(loss_func, micro_batch)


def _to_device(micro_batch: MicroBatch, device: torch.device) -> MicroBatch:
    if device.type == "cpu":
        return micro_batch
    moved = micro_batch.map_positions(lambda tensor: tensor.to(device))
    return dataclasses.replace(moved, row_token_counts=micro_batch.row_token_counts.to(device),
                               packed=None if micro_batch.packed is None else micro_batch.packed.to(device))


def _run_schedule(model_chunks, micro_batches: list[MicroBatch], loss_func, forward_only: bool, device):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micro_batches = [_to_device(mb, device) for mb in micro_batches]
    geometry = _geometry(micro_batches)
    forward_backward = get_forward_backward_func()
    # The interleaved schedule (virtual pipeline) runs each model chunk over every micro-batch, in
    # order, from an iterator of its own.
    data = iter(micro_batches) if len(model_chunks) == 1 else [iter(micro_batches) for _ in model_chunks]
    return forward_backward(
        forward_step_func=partial(_forward_step, loss_func),
        data_iterator=data,
        model=model_chunks,
        num_microbatches=len(micro_batches),
        seq_length=geometry.seq_length,
        micro_batch_size=geometry.micro_batch_size,
        forward_only=forward_only,
    )


def token_logprobs_and_entropy(micro_batch: MicroBatch, logits: torch.Tensor, *, temperature: float,
                               vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy of the targets from this rank's logit shard: over each token's
    sampling support when the micro-batch carries one (sampling replay), else the full vocabulary.
    The targets were checked on the host before the pass (check_targets_on_host)."""
    ignore = ~micro_batch.loss_mask
    if micro_batch.support is None:
        return vocab_parallel_logprobs_and_entropy(logits, micro_batch.targets, temperature=temperature,
                                                   vocab_size=vocab_size, ignore_mask=ignore, checked=True)
    return vocab_parallel_support_logprobs_and_entropy(logits, micro_batch.targets, micro_batch.support,
                                                       temperature=temperature, vocab_size=vocab_size,
                                                       ignore_mask=ignore, checked=True)


def check_targets_on_host(micro_batches: list[MicroBatch], vocab_size: int) -> None:
    """The log-prob ops' checks of targets (and sampling supports), run once per pass on the
    micro-batches' host tensors, before they move to the device: the ops then read nothing back."""
    if not micro_batches:
        return
    flatten_ignored(torch.cat([mb.targets.reshape(-1) for mb in micro_batches]),
                    torch.cat([~mb.loss_mask.reshape(-1) for mb in micro_batches]), -100, vocab_size)
    for micro_batch in (mb for mb in micro_batches if mb.support is not None):  # (supports differ in width)
        ignored = flatten_ignored(micro_batch.targets, ~micro_batch.loss_mask, -100, vocab_size, checked=True)
        check_supports(micro_batch.targets, micro_batch.support, ignored, vocab_size,
                       default_chunk_size(max(micro_batch.support.shape[-1], 1), torch.device("cpu")))


def compute_logprobs(model_chunks, micro_batches: list[MicroBatch], *, temperature: float, vocab_size: int,
                     device: torch.device) -> list[torch.Tensor] | None:
    """Forward-only pass; returns per-position log-probs per micro-batch, in its layout ([b, s]
    padded, [1, T] packed; this CP rank's positions; 0 outside the loss mask) on the last pipeline
    stage, None on other stages."""
    from megatron.core import parallel_state

    def loss_func(micro_batch: MicroBatch, logits: torch.Tensor):
        logp = token_logprobs_and_entropy(micro_batch, logits, temperature=temperature, vocab_size=vocab_size)[0]
        return torch.zeros((), device=logits.device), {"logprobs": logp.detach()}  # read after the pass

    check_targets_on_host(micro_batches, vocab_size)
    with torch.no_grad():
        outputs = _run_schedule(model_chunks, micro_batches, loss_func, forward_only=True, device=device)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    values = [out["logprobs"] for out in outputs]
    if not values:
        return []
    # one host read for the whole pass (the schedule never waits for one)
    flat = torch.cat([v.reshape(-1) for v in values]).cpu().split([v.numel() for v in values])
    return [f.reshape(v.shape) for f, v in zip(flat, values)]


def response_logprobs(micro_batches: list[MicroBatch], logprobs: list[torch.Tensor], samples: list[TrainSample],
                      device: torch.device) -> dict[int, list[float]]:
    """compute_logprobs' output as {sample index: one log-prob per response token}; under context
    parallelism each micro-batch's values are first gathered over the CP group (collective)."""
    from megatron.core import parallel_state

    from megatron_grpo.ops.context_parallel import gather_from_context_parallel, gather_packed_from_context_parallel

    context_parallel = parallel_state.get_context_parallel_world_size() > 1
    out: dict[int, list[float]] = {}
    for micro_batch, values in zip(micro_batches, logprobs):
        if context_parallel:
            local = values.to(device)
            full = (gather_from_context_parallel(local) if micro_batch.packed is None else
                    gather_packed_from_context_parallel(local, micro_batch.packed.cu_seqlens_padded))
            values = full.cpu()
        flat = values.reshape(-1)
        for index, start in zip(micro_batch.sample_indices, micro_batch.sequence_starts()):
            sample = samples[index]
            first = start + len(sample.prompt_ids) - 1  # where the first response token is predicted
            out[index] = flat[first:first + len(sample.response_ids)].tolist()
    return out


def fill_logprobs(model_chunks, samples: list[TrainSample], cfg, name: str, *, model_config, temperature: float,
                  device: torch.device, skip_mini_batches: int = 0) -> None:
    """Sets samples[i].<name> ("old_logprobs" / "ref_logprobs") for this rank's samples on the last
    pipeline stage: a forward-only pass over micro-batches planned with the pass's own token
    budget (micro_batches.MicroBatching.from_config), from mini-batch `skip_mini_batches` on."""
    from megatron_grpo.trainer.batches.micro_batches import plan_micro_batches

    plan = plan_micro_batches(samples, cfg, purpose=name, model_config=model_config,
                              skip_mini_batches=skip_mini_batches)
    for micro_batches in plan:
        logprobs = compute_logprobs(model_chunks, micro_batches, temperature=temperature,
                                    vocab_size=model_config.vocab_size, device=device)
        if logprobs is None:  # not the last pipeline stage: the loss is computed there
            continue
        with torch.no_grad():
            for index, values in response_logprobs(micro_batches, logprobs, samples, device).items():
                setattr(samples[index], name, values)


def train_on_mini_batch(model_chunks, optimizer, micro_batches: list[MicroBatch], *, loss_config: GRPOLossConfig,
                        batch_info: GlobalBatchInfo, temperature: float, vocab_size: int,
                        device: torch.device, need_entropy: bool,
                        sample_staleness: list[int] | None = None,
                        mismatch: MismatchHealth | None = None,
                        progress: Callable[[int, int], None] | None = None) -> dict[str, float]:
    """forward_backward over this rank's micro-batches, then one optimizer step; `progress(k, n)`
    after micro-batch k of n has its loss (the hang watchdog's heartbeat).

    Returns mini-batch metrics (identical on every rank): loss terms and actor metrics summed over
    micro-batches and ranks (they are additive shares), grad norm, and whether the update was
    skipped because of a non-finite gradient. With `sample_staleness` (weight versions each sample
    of the batch is behind the trainer; asynchronous rollouts) also the proximal / behaviour ratio's
    mean and max and the mean |log-prob gap| per staleness (off_policy/logprob_gap/staleness_<s>).
    With `mismatch`, every trained token's trainer-vs-behaviour log-prob difference (at the weights
    of the step start) is added to it (trainer/step/mismatch.py)."""
    from megatron.core import parallel_state

    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    off_policy = loss_config.off_policy
    needs_rollout = bool(loss_config.policy_clip.tis_cap) or off_policy.weighted or \
        off_policy.objective == "behaviour"

    done = [0]

    def loss_func(micro_batch: MicroBatch, logits: torch.Tensor):
        if progress is not None:
            done[0] += 1
            progress(done[0], len(micro_batches))
        logp, entropy = token_logprobs_and_entropy(micro_batch, logits, temperature=temperature,
                                                   vocab_size=vocab_size)
        # The loss sees one row per sequence in either layout (packed rows are unpacked here:
        # per-token values only, so sequence-level terms see the padded layout's rows).
        rows = micro_batch.rows
        logp, entropy, mask = rows(logp), rows(entropy), rows(micro_batch.loss_mask)
        per_token = {name: rows(values) for name, values in micro_batch.per_token.items()}
        # what the tokens were really sampled with (the truncated distribution when sampling was)
        behaviour = per_token.get("behaviour_logprobs", per_token.get("rollout_logprobs"))
        # One on-policy update per rollout: old == current (detached), so the ratio is exactly 1.
        old = per_token.get("old_logprobs", logp.detach())
        output = compute_grpo_loss(
            logp, old, rows(micro_batch.advantages), mask, batch_info, loss_config,
            ref_log_prob=per_token.get("ref_logprobs"),
            entropy=entropy if need_entropy else None,
            rollout_log_prob=behaviour if needs_rollout else None,
            seq_token_counts=micro_batch.row_token_counts)
        metrics = {"actor/loss": output.share, **output.metrics}
        zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
        metrics["actor/ratio_max_abs_dev"] = torch.where(mask, (logp.detach() - old).exp() - 1, zero).abs().max()
        if "rollout_logprobs" in per_token:
            # engine vs trainer on the weights of the step start (`old`), not the current ones: after
            # the step's first optimizer step the difference would include the update itself
            if mismatch is not None:
                delta = torch.where(mask, old - behaviour, zero)
                mismatch.add_rows(micro_batch.sample_indices, delta, mask, per_token["response_fraction"])
            diff = torch.where(mask, old - per_token["rollout_logprobs"], zero).abs()
            metrics["actor/logprob_abs_diff_mean"] = diff.sum() / max(batch_info.num_valid_tokens, 1)
            metrics["actor/logprob_abs_diff_max"] = diff.max()
            if sample_staleness is not None:
                metrics.update(_staleness_metrics(micro_batch, old, behaviour, mask, batch_info,
                                                  sample_staleness, with_mean=not off_policy.weighted))
        # on the device: the host reads them once per mini-batch (_reduce_metrics), not per micro-batch
        return output.loss, {k: v.detach().float() for k, v in metrics.items()}

    check_targets_on_host(micro_batches, vocab_size)
    with RouterStats(model_chunks) as router_stats:  # MoE models: moe/* (expert load, router entropy, ...)
        outputs = _run_schedule(model_chunks, micro_batches, loss_func, forward_only=False, device=device)
    update_ok, grad_norm, _ = optimizer.step()
    metrics = _gap_means(_reduce_metrics(outputs if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else []))
    metrics.update(router_stats.metrics())
    metrics["actor/grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    metrics["actor/update_skipped"] = 0.0 if update_ok else 1.0
    return metrics


def _staleness_metrics(micro_batch: MicroBatch, proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor,
                       batch_info: GlobalBatchInfo, sample_staleness: list[int], with_mean: bool) -> dict:
    """Additive shares (and one max) of the off-policy diagnostics of one micro-batch's rows."""
    from megatron_grpo.algo import token_mean_share

    indices = micro_batch.sample_indices
    # -1: a row of padding only
    row_staleness = [sample_staleness[i] for i in indices] + [-1] * (mask.shape[0] - len(indices))
    zero = torch.zeros((), dtype=proximal.dtype, device=proximal.device)
    log_ratio = (proximal - behaviour).detach().clamp(-SAFETY_BOUND, SAFETY_BOUND)
    ratio = torch.where(mask, log_ratio.exp(), zero)
    out = {"off_policy/is_ratio_max": ratio.max()}
    if with_mean:  # (a weighted loss reports the mean at its own level)
        out["off_policy/is_ratio_mean"] = token_mean_share(ratio, mask, batch_info)
    for staleness, (total, count) in staleness_gap_sums(proximal, behaviour, mask, row_staleness).items():
        if staleness >= 0:
            out[f"{_GAP_SUM}{staleness}"], out[f"{_GAP_COUNT}{staleness}"] = total, count
    return out


def _gap_means(metrics: dict[str, float]) -> dict[str, float]:
    """off_policy/gap_sum/<s> and gap_count/<s> (summed over micro-batches and ranks) -> the mean."""
    out = {k: v for k, v in metrics.items() if not k.startswith((_GAP_SUM, _GAP_COUNT))}
    for key, total in metrics.items():
        if key.startswith(_GAP_SUM):
            staleness = key[len(_GAP_SUM):]
            count = metrics.get(_GAP_COUNT + staleness, 0.0)
            if count > 0:
                out[f"off_policy/logprob_gap/staleness_{staleness}"] = total / count
    return out


def holds_distinct_tokens() -> bool:
    """Whether this rank's loss values are its own: a last pipeline stage's tensor-parallel rank 0
    (TP ranks compute identical values; CP and DP ranks hold different tokens)."""
    from megatron.core import parallel_state

    return (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            and parallel_state.get_tensor_model_parallel_rank() == 0)


def _reduce_metrics(outputs: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Sums additive shares (max for MAX_METRICS) over micro-batches, then over the ranks that
    hold distinct data: last-stage ranks with TP rank 0 (TP ranks compute identical values)."""
    local: dict[str, float] = {}
    keys = [key for output in outputs for key in output]
    values = torch.stack([v.reshape(()) for output in outputs for v in output.values()]).tolist() if keys else []
    for key, value in zip(keys, values):  # one host read for every micro-batch's metrics
        local[key] = max(local.get(key, value), value) if key in MAX_METRICS else local.get(key, 0.0) + value
    contributes = bool(outputs) and holds_distinct_tokens()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local if contributes else {})
    total: dict[str, float] = {}
    for part in gathered:
        for key, value in part.items():
            total[key] = max(total.get(key, value), value) if key in MAX_METRICS else total.get(key, 0.0) + value
    return total
