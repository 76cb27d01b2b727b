"""The plan as a table, and the one line that refuses a layout that does not fit."""
from __future__ import annotations

from megatron_grpo.config.schema import Config
from megatron_grpo.plan.engines import parameter_count
from megatron_grpo.plan.recipe_plan import RecipePlan
from megatron_grpo.plan.stage import RESIDENT, StageMemory

GIB = 2**30


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f}"


def render(plan: RecipePlan, recipe: str) -> str:
    c, p, layout = plan.cluster, plan.placement, plan.layout
    dp = layout.data_parallel_size(p.trainer_gpus)
    shape = f"TP {layout.tensor} x PP {layout.pipeline} x CP {layout.context} x DP {dp}" + (
        f", EP {layout.expert} x ETP {layout.expert_tensor_size}" if plan.arch.is_moe else "") + (
        f", VPP {layout.virtual_pipeline}" if layout.virtual_pipeline else "")
    lines = [f"megatron-grpo plan: {recipe} on {c.nodes} nodes x {c.gpus_per_node} GPUs of {c.gpu_memory_gb:g} GiB",
             f"  trainer: {p.trainer_gpus} GPUs, {shape}; engines: {p.kind}"
             + (f" ({p.engine_nodes} nodes)" if p.kind == "dedicated" else ""),
             f"  model: {parameter_count(plan.arch) / 1e9:.1f} B parameters, config from {plan.model_source}",
             "",
             "trainer memory per GPU (GiB), one rank of each pipeline stage, simulated on fake tensors:",
             f"  {'stage (rank)':14} {'params':>7} {'grads':>7} {'optim':>7} {'ref':>6} {'act':>6} {'logits':>6} "
             f"{'peak':>7}  phase of the peak (largest transient)",
             "  (act, logits: layer activations with the recipe's recompute, and the logits / loss buffers, at the"
             " train phase's peak)"]
    for stage in plan.stages:
        r, peak = stage.resident, stage.peak
        train = next(p for p in stage.phases if p.phase.startswith("train"))
        transient = {k: v for k, v in peak.by_category.items() if k not in RESIDENT}
        largest = max(transient.items(), key=lambda kv: kv[1], default=("-", 0))
        act, logits = train.by_category.get("activations", 0), train.by_category.get("logits/loss", 0)
        lines.append(f"  {f'{stage.stage + 1} ({stage.rank})':14} {gib(r.get('parameters', 0)):>7} "
                     f"{gib(r.get('gradient buffers', 0)):>7} {gib(r.get('optimizer state', 0)):>7} "
                     f"{gib(peak.by_category.get('reference', 0)):>6} {gib(act):>6} {gib(logits):>6} "
                     f"{gib(peak.peak_bytes):>7}  {peak.phase} ({largest[0]} {gib(largest[1])})")
    lines.append("  phases (peak GiB): " + "; ".join(
        f"stage {s.stage + 1}: " + ", ".join(f"{ph.phase} {gib(ph.peak_bytes)}" for ph in s.phases
                                             if not ph.phase.startswith("build"))
        for s in plan.stages))
    host, ranks = max(s.save_host_bytes for s in plan.stages), min(c.gpus_per_node, p.trainer_gpus)
    lines.append(f"  checkpoint save: nothing on the GPU; up to {gib(host)} GiB of host memory per rank "
                 f"({gib(host * ranks)} GiB per node of {ranks} ranks) hold the copies the checkpoint writer "
                 f"makes of what the rank writes (its optimizer slices; the weights) until the write ends")
    first = plan.stages[0]
    lines.append(f"  train micro-batch: {first.micro_batch_tokens} tokens, {first.train_micro_batches} in flight; "
                 f"budget {gib(c.trainer_budget_bytes)} GiB ({c.gpu_memory_gb:g} less {c.reserve_gb:g} reserved for "
                 f"the CUDA context, NCCL and fragmentation); simulated in {plan.seconds:.0f} s")
    if plan.engines is not None:
        e = plan.engines
        flight = "the whole step in flight" if e.step_in_flight else \
            f"{e.capacity_tokens * 100 // max(e.step_tokens_per_engine, 1)}% of the step in flight at once"
        length = e.step_tokens_per_engine // max(e.sequences_per_engine, 1)
        lines += ["", f"engines: {e.engines} x tp {e.tp_size}: weights {gib(e.weights_per_gpu)} GiB per GPU, "
                      f"KV pool {gib(max(e.kv_pool_per_gpu, 0))} GiB per GPU "
                      f"({e.kv_bytes_per_token_per_gpu // 1024} KiB per token) = {e.capacity_tokens:,} tokens per "
                      f"engine; the step: {e.sequences_per_engine} sequences x {length} tokens per engine -> {flight}"]
        if not e.fits:
            lines.append("  the weights alone exceed rollout.sglang.mem_fraction of a GPU: raise tp_size")
    if plan.sync is not None:
        s = plan.sync
        timing = (f", ~{s.seconds:.1f} s for the largest stage at {s.link_gbps:g} Gb/s per link"
                  if "NCCL" in s.route else "")
        lines.append(f"weight sync: {gib(s.model_bytes)} GiB of bf16 tensors per sync ({s.route}){timing}")
    lines += ["", verdict(plan)]
    return "\n".join(lines) + "\n"


def verdict(plan: RecipePlan) -> str:
    if plan.fits:
        stage = plan.peak_stage
        return (f"fits: peak {gib(stage.peak.peak_bytes)} of {gib(plan.cluster.trainer_budget_bytes)} GiB "
                f"(stage {stage.stage + 1}, {stage.peak.phase})")
    if not plan.trainer_fits:
        return refusal(plan)
    return "does not fit: the engine weights exceed rollout.sglang.mem_fraction of a GPU (raise rollout.sglang.tp_size)"


def refusal(plan: RecipePlan) -> str:
    """One line: the stage, the phase, the largest term and what to change."""
    stage = plan.peak_stage
    peak = stage.peak
    term, size = max(peak.by_category.items(), key=lambda kv: kv[1])
    return (f"does not fit: pipeline stage {stage.stage + 1} (rank {stage.rank}) peaks at {gib(peak.peak_bytes)} GiB "
            f"of {gib(plan.cluster.trainer_budget_bytes)} in the {peak.phase}; largest term {term} {gib(size)} GiB; "
            f"try {suggestion(plan, stage, term)}")


def suggestion(plan: RecipePlan, stage: StageMemory, term: str) -> str:
    cfg: Config = plan.config
    layout = plan.layout
    if term in ("parameters", "gradient buffers", "optimizer state"):
        return (f"parallel.pipeline={layout.pipeline * 2} (fewer layers per GPU) or more GPUs for data parallelism "
                f"(the distributed optimizer shards its state over them)")
    if term == "reference" and not cfg.ref.param_offload:
        return "ref.param_offload=true (reference weights on the host between its passes)"
    if term == "activations":
        if cfg.model.recompute_granularity != "full":
            return "model.recompute_granularity=full (recompute each layer in backward)"
        budget = cfg.actor.max_tokens_per_micro_batch
        if budget:
            return f"actor.max_tokens_per_micro_batch={budget // 2} (from {budget})"
        return f"parallel.context={layout.context * 2} (split each sequence over more GPUs)"
    if term == "sync buckets":
        return f"rollout.weight_bucket_mb={max(cfg.rollout.weight_bucket_mb // 2, 1)}"
    return f"parallel.pipeline={layout.pipeline * 2}"

