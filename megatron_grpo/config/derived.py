"""What a recipe implies beyond its keys, decided in one place (no torch): where the local engine
runs, which route the weights take, what asynchronous rollouts change, and which settings have no
effect. The trainer acts on these; `config show` prints them as comments above the YAML (ignored
when it is loaded back)."""
from __future__ import annotations

from megatron_grpo.config.schema import Config


def rollouts_run_ahead(cfg: Config) -> bool:
    """Asynchronous GRPO: batches are generated ahead of training (rollout.max_staleness > 0;
    trainer/rollouts/rollout_pipeline.py), so samples may be up to that many versions old."""
    return cfg.rollout.max_staleness > 0


def engine_in_own_process(cfg: Config) -> bool:
    """rollout.local.process, or by default: when rollouts run ahead of training."""
    local = cfg.rollout.local
    return local.process if local.process is not None else rollouts_run_ahead(cfg)


def sampling_replay_enabled(cfg: Config) -> bool:
    """Whether the trainer computes its log-probs over each token's sampling support
    (rollout.sampling_replay: auto = whenever top-p, top-k or min-p truncate the distribution, except
    top_k=1 (a support of one token: every log-prob 0, nothing to train) and multi-turn rollouts
    (observation tokens have no support); on = whenever truncated, validate.py refuses those two)."""
    r = cfg.rollout
    truncated = r.top_p < 1 or r.top_k != -1 or r.min_p > 0
    if r.sampling_replay == "auto":
        return truncated and r.top_k != 1 and r.multi_turn.environment is None
    return truncated and r.sampling_replay == "on"


def weight_sync_route(cfg: Config) -> str:
    """per_stage, colocated or rank0 (rollout.weight_sync_route; validate.py refuses a route the
    engine cannot take)."""
    route = cfg.rollout.weight_sync_route
    if route != "auto":
        return route
    r = cfg.rollout
    if r.engine == "sglang":
        if r.sglang.weight_sync == "tensor":
            return "colocated"
        # Without pipeline stages the one sender is rank 0 either way: keep the rank-0 route, whose
        # engine-fault recovery (restarts, dropped URLs mid-sync) the fault tests exercise most.
        distributed = r.sglang.weight_sync == "distributed"
        return "per_stage" if distributed and cfg.parallel.pipeline > 1 else "rank0"
    return "per_stage" if engine_in_own_process(cfg) else "rank0"


def engine_memory_released(cfg: Config) -> bool:
    """Whether launched SGLang engines give their memory to training after each rollout: colocated
    engines (weight_sync=tensor) on GPUs, through SGLang's memory saver. SGLang 0.5.23 has none on a
    CPU (torch_memory_saver needs CUDA; /release_memory_occupation without it stops the server)."""
    s = cfg.rollout.sglang
    return cfg.rollout.engine == "sglang" and s.weight_sync == "tensor" and s.device == "cuda"


def engine_kv_tokens(cfg: Config) -> int | None:
    """A launched SGLang engine's KV cache in tokens (--max-total-tokens): rollout.sglang.max_total_tokens,
    or on a CPU, where SGLang would take the machine's RAM for it, what max_concurrency sequences of
    the longest length hold; None: SGLang sizes it from mem_fraction."""
    s = cfg.rollout.sglang
    if s.max_total_tokens is not None:
        return s.max_total_tokens
    if s.device != "cpu":
        return None
    return s.max_concurrency * longest_sequence(cfg)


def long_tail_enabled(cfg: Config) -> bool:
    """Whether rounds over-sample and abort the tail (rollout.long_tail.over_sampling_groups > 0)."""
    return cfg.rollout.long_tail.over_sampling_groups > 0


def carried_staleness(cfg: Config) -> int | None:
    """How many weight versions behind the trained ones a carried token may be (partial rollouts): the
    staleness bound, at least 1 (max_staleness 0 with allow_off_policy); None without partial rollouts."""
    if not (long_tail_enabled(cfg) and cfg.rollout.long_tail.partial_rollout):
        return None
    return max(cfg.rollout.max_staleness, 1)


def longest_sequence(cfg: Config) -> int:
    """Prompt + response tokens of the longest trajectory a rollout may produce."""
    d = cfg.data
    return cfg.rollout.multi_turn.max_length or d.max_prompt_length + d.max_response_length


def implied_settings(cfg: Config) -> list[str]:
    """One line per implied setting, for `config show`."""
    r = cfg.rollout
    lines = []
    staleness = r.max_staleness
    if staleness:
        lines.append(f"rollout.max_staleness={staleness}: rollouts of the next steps run during training; no sample "
                     f"trains more than {staleness} weight version(s) after the one that generated it")
        off_policy = cfg.actor.off_policy
        if off_policy.is_level == "auto":
            level = off_policy.resolve(staleness, cfg.actor.tis_cap).is_level
            lines.append(f"actor.off_policy.is_level=auto: {'token-level truncated IS' if level else 'none'} "
                         f"(auto = token TIS when max_staleness > 0 and no other correction is set; null = off)")
    else:
        lines.append("rollout.max_staleness=0: on-policy, generate -> train -> sync, step after step")
    if r.engine == "local":
        where = "its own process" if engine_in_own_process(cfg) else "the trainer's process (rank 0)"
        why = "rollout.local.process" if r.local.process is not None else "rollout.local.process=null: by max_staleness"
        lines.append(f"local engine: in {where} ({why})")
    elif staleness:
        lines.append("SGLang requests aborted by a weight update are resubmitted and served by the new weights")
    route = weight_sync_route(cfg)
    how = {"rank0": "every stage's tensors through global rank 0, which pushes them",
           "per_stage": "each pipeline stage's first rank pushes its own layers",
           "colocated": "every trainer rank feeds the SGLang engine rank on its GPU"}[route]
    source = "rollout.weight_sync_route" if r.weight_sync_route != "auto" else "rollout.weight_sync_route=auto"
    lines.append(f"weight sync route: {route}, {how} ({source})")
    if long_tail_enabled(cfg):
        lt = r.long_tail
        kept = (f"partial rollouts carried and continued next round, tokens at most {carried_staleness(cfg)} "
                f"version(s) behind" if lt.partial_rollout else "what the abort left is discarded")
        lines.append(f"long tail: {lt.over_sampling_groups} extra group(s) per round, the rest aborted once the "
                     f"batch's groups are complete; {kept}")
    if sampling_replay_enabled(cfg):
        lines.append(f"sampling replay: on (rollout.sampling_replay={r.sampling_replay}): log-probs over each token's "
                     f"top-p/top-k/min-p support, as the engine sampled")
    elif r.top_p < 1 or r.top_k != -1 or r.min_p > 0:
        lines.append(f"sampling replay: off (rollout.sampling_replay={r.sampling_replay}): sampling is truncated but "
                     f"the trainer's log-probs are of the full distribution; off_policy and mismatch/* show the bias")
    return lines + inert_settings(cfg)


# Keys that act only with algorithm.use_kl_in_reward=true (as in verl, whose examples set kl_ctrl.*
# with it false): accepted, with a note (inert_settings), never refused.
INERT_WITHOUT_KL_IN_REWARD = (
    "algorithm.kl_penalty", "algorithm.kl_ctrl.type", "algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.horizon",
    "algorithm.kl_ctrl.target_kl",
)


def inert_settings(c: Config) -> list[str]:
    """One line per setting that differs from its default but has no effect in this config."""
    if c.algorithm.use_kl_in_reward:
        return []
    return [f"{key}={value!r} has no effect: algorithm.use_kl_in_reward=false (as in verl)"
            for key, value, default in values_at(c, INERT_WITHOUT_KL_IN_REWARD) if value != default]


def values_at(c: Config, keys) -> list[tuple[str, object, object]]:
    """(key, value in c, default) for dotted keys."""
    defaults, out = Config(), []
    for key in keys:
        value, default = c, defaults
        for part in key.split("."):
            value, default = getattr(value, part), getattr(default, part)
        out.append((key, value, default))
    return out


def overlong_cap(c: Config) -> int:
    """The response length reward.overlong_buffer's penalty ends at (its max_response_length, else
    data.max_response_length)."""
    return c.reward.overlong_buffer.max_response_length or c.data.max_response_length
