"""The train step reads nothing back to the host per micro-batch: every `.item()`, `.tolist()`,
`.cpu()`, `.nonzero()` and tensor-to-Python conversion is counted (megatron_grpo/testing/host_syncs.py)
over one mini-batch of the same 16 samples, split into 1 and into many micro-batches, padded and
packed, with the off-policy diagnostics and the mismatch health on (what a GPU would wait for).

- Inside the forward-backward schedule our code reads nothing. What reads there is listed in
  UPSTREAM with why: megatron-core's own code, and the CPU attention backend.
- The whole mini-batch (the target checks before it on the host, the schedule, the optimizer step,
  the one reduction of the metrics) reads as often with many micro-batches as with one, UPSTREAM
  aside: a fixed few per mini-batch, none per micro-batch."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from megatron_grpo.testing.distributed import run_distributed

# Reads inside the schedule this project does not own, and why a GPU run does not pay them here.
UPSTREAM = {
    "megatron/core/tensor_parallel/random.py": "the RNG tracker compares torch's CPU RNG state (host memory)",
    "megatron/core/models/common/embeddings/rope_utils.py": "the unfused THD RoPE reads cu_seqlens (packed rows "
                                                              "without TE's fused RoPE)",
    "megatron_grpo/ops/varlen_attention.py": "the local attention backend (CPU); GPUs run TE's or torch's varlen "
                                             "kernel (model.attention_backend)",
}


def _upstream(site: str) -> bool:
    return site.rsplit(":", 1)[0] in UPSTREAM


def _mini_batch(rank, world_size, policy, budget, packing):
    from megatron_grpo.config import load_config
    from megatron_grpo.convert import load_hf_weights
    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import ModelArchitecture, build_model
    from megatron_grpo.testing.host_syncs import counting_host_syncs
    from megatron_grpo.trainer.assembly.optimizer import OptimizerSettings, build_optimizer, wrap_with_ddp
    from megatron_grpo.trainer.batches.micro_batches import plan_micro_batches
    from megatron_grpo.trainer.step import train_step
    from megatron_grpo.trainer.step.mismatch import MismatchHealth
    from megatron_grpo.trainer.step_settings import global_batch_info, grpo_loss_config
    from tests.first_step import uneven_samples

    cfg = load_config("tiny_cpu", ["rollout.n=4", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
                                   f"actor.max_tokens_per_micro_batch={budget}", "actor.entropy_coeff=0.01",
                                   f"actor.packing={packing}", "rollout.max_staleness=2"])
    initialize_model_parallel(ParallelLayout(), seed=1)
    arch = ModelArchitecture.from_hf(policy, tensor_parallel=1, vocab_multiple=8)
    chunks = build_model(arch, ParallelLayout())
    load_hf_weights(chunks, arch, policy)
    model = wrap_with_ddp(chunks, use_distributed_optimizer=True)
    optimizer, _ = build_optimizer(model, OptimizerSettings(lr=1e-3, use_distributed_optimizer=True))
    samples = uneven_samples(16, arch.vocab_size)
    for i, sample in enumerate(samples):
        sample.rollout_logprobs = [-1.0 - 0.01 * i] * len(sample.response_ids)
    (micro_batches,) = plan_micro_batches(samples, cfg, model_config=arch)
    staleness = [i % 3 for i in range(len(samples))]
    schedule, inside = train_step._run_schedule, Counter()

    def counted_schedule(*args, **kwargs):
        with counting_host_syncs() as counts:
            try:
                return schedule(*args, **kwargs)
            finally:
                inside.update(counts)

    train_step._run_schedule = counted_schedule
    with counting_host_syncs() as whole:
        train_step.train_on_mini_batch(
            model, optimizer, micro_batches, loss_config=grpo_loss_config(cfg),
            batch_info=global_batch_info(micro_batches, cfg), temperature=1.0, vocab_size=arch.vocab_size,
            device=torch.device("cpu"), need_entropy=True, sample_staleness=staleness,
            mismatch=MismatchHealth(["engine"] * len(samples), staleness))
    return len(micro_batches), dict(inside), dict(whole)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from megatron_grpo.models.tiny import save_tiny_hf_model

    folder = tmp_path_factory.mktemp("host_syncs") / "policy"
    save_tiny_hf_model("qwen3", folder, seed=0)
    return str(folder)


@pytest.mark.parametrize("packing", [False, True])
def test_no_host_read_per_micro_batch(policy, packing):
    one, inside_one, whole_one = run_distributed(_mini_batch, 1, (policy, 4096, packing), timeout=300)[0]
    many, inside_many, whole_many = run_distributed(_mini_batch, 1, (policy, 32, packing), timeout=300)[0]
    assert one == 1 and many >= 6, (one, many)
    ours = {key: count for key, count in inside_many.items() if not _upstream(key[1])}
    assert not ours, f"host reads inside the schedule ({many} micro-batches): {ours}"
    fixed_one = {key: count for key, count in whole_one.items() if not _upstream(key[1])}
    fixed_many = {key: count for key, count in whole_many.items() if not _upstream(key[1])}
    assert fixed_many == fixed_one, (fixed_one, fixed_many)
