"""Rollout routing replay (models/routing_replay.py, rollout/routed_experts.py, convert/fused_experts.py,
rollout/local.py).

The local engine samples from the tiny Qwen3-MoE and records, per position and layer, the experts
it routed to. The trainer (megatron, the same weights) recomputes the response log-probs with the
trainer's own pieces (micro-batches, fill_logprobs). Perturbing the trainer's router weights
slightly (relative 2e-2) stands for the engine/trainer numerics mismatch of a real run: without
replay some tokens' top-k flips and the engine-vs-trainer log-prob gap grows (measured: 2.6e-7
unperturbed -> 1.1e-2 mean |diff|); with replay the trainer uses the engine's experts (gate weights
from its own, perturbed, router) and only the smooth part of the perturbation is left, what a dense
model shows for a perturbed weight (no discrete choice to flip): measured 6.4e-4. Both parts grow
linearly with the perturbation (flips in proportion to the near-ties it crosses), so their ratio,
~18, does not depend on its size; the test asks for 10.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_grpo.models.tiny import save_tiny_hf_model
from megatron_grpo.testing.distributed import run_distributed

PERTURBATION = 2e-2


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return str(save_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("replay") / "hf", seed=1))


def _engine_samples(path):
    from megatron_grpo.rollout.local import LocalEngine
    from megatron_grpo.rollout.types import GenerationRequest, SamplingParams

    engine = LocalEngine.from_pretrained(path, eos_token_ids=[], seed=0)
    rng = torch.Generator().manual_seed(0)
    requests = [GenerationRequest(prompt_ids=tuple(torch.randint(0, 250, (length,), generator=rng).tolist()),
                                  sampling=SamplingParams(n=3, max_new_tokens=12, seed=11 + i), group_id=str(i))
                for i, length in enumerate((3, 9, 5, 14))]
    return engine, engine.generate(requests)


def test_local_engine_records_the_routes_of_every_fed_position(moe_path):
    """Routes of prompt + response[:-1]: equal to the HF model's own routing of the full sequence
    in one forward (the KV-cache decode routes the same tokens the same way)."""
    from megatron_grpo.rollout.routed_experts import RoutedExpertsRecorder

    engine, samples = _engine_samples(moe_path)
    recorder = RoutedExpertsRecorder(engine.model)
    for sample in samples:
        sequence = sample.prompt_ids + sample.response_ids
        assert isinstance(sample.routed_experts, np.ndarray)  # pickled by value to the trainer's process
        routes = torch.from_numpy(sample.routed_experts)
        assert tuple(routes.shape) == (len(sequence) - 1, 4, 2) and routes.dtype == torch.int32
        assert (routes[:, 2] == -1).all() and (routes[:, [0, 1, 3]] >= 0).all()  # layer 2 is dense
        with torch.no_grad():
            engine.model(torch.tensor([sequence]))
        full = recorder.take(1, len(sequence))[0, :-1]
        same = (torch.sort(full, dim=-1).values == torch.sort(routes, dim=-1).values).all(dim=-1).float().mean()
        assert same >= 0.99, f"{same:.3f} of (position, layer) routes agree"
    recorder.remove()


def test_fused_expert_weights_load_into_the_engine(moe_path):
    """The exporter's per-expert names reach transformers 5's fused expert parameters."""
    from safetensors.torch import load_file

    from megatron_grpo.convert.fused_experts import ExpertStreamError
    from megatron_grpo.rollout.local import LocalEngine

    tensors = load_file(f"{moe_path}/model.safetensors")
    engine = LocalEngine.from_pretrained(moe_path)
    doubled = {name: 2 * tensor for name, tensor in tensors.items()}
    report = engine.load_weights(doubled.items(), version=3)
    assert report.missing == [] and engine.weight_version == 3
    experts = engine.model.model.layers[1].mlp.experts
    assert torch.equal(experts.gate_up_proj[5], torch.cat([doubled["model.layers.1.mlp.experts.5.gate_proj.weight"],
                                                           doubled["model.layers.1.mlp.experts.5.up_proj.weight"]]))
    assert torch.equal(experts.down_proj[7], doubled["model.layers.1.mlp.experts.7.down_proj.weight"])
    partial = [(n, t) for n, t in tensors.items() if n != "model.layers.3.mlp.experts.4.up_proj.weight"]
    with pytest.raises(ExpertStreamError, match="layer 3"):
        engine.load_weights(partial, version=4)


def _gaps(rank, world_size, path, samples):
    from megatron_grpo.config import load_config
    from megatron_grpo.convert import load_hf_weights
    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import ModelArchitecture, build_reference_model
    from megatron_grpo.models.routing_replay import moe_routers
    from megatron_grpo.trainer.batches.batching import TrainSample
    from megatron_grpo.trainer.step.train_step import fill_logprobs

    cfg = load_config("tiny_cpu", ["rollout.n=3", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4"])
    initialize_model_parallel(ParallelLayout(), seed=1)
    mc = ModelArchitecture.from_hf(path, vocab_multiple=8)
    chunks = build_reference_model(mc)
    load_hf_weights(chunks, mc, path)

    def gap(replay: bool) -> float:
        batch = [TrainSample(s.prompt_ids, s.response_ids, 1.0, rollout_logprobs=s.logprobs,
                             routed_experts=s.routed_experts if replay else None) for s in samples]
        fill_logprobs(chunks, batch, cfg, "old_logprobs", model_config=mc, temperature=1.0, device=torch.device("cpu"))
        diffs = np.concatenate([np.abs(np.array(s.old_logprobs) - np.array(s.rollout_logprobs)) for s in batch])
        return float(diffs.mean())

    out = {"same": gap(False), "same_replay": gap(True)}
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, router in moe_routers(chunks[0]):
            weight = router.weight
            weight.add_(PERTURBATION * weight.abs().mean() * torch.randn(weight.shape, generator=generator))
    out["perturbed"], out["perturbed_replay"] = gap(False), gap(True)
    return out


def test_replay_removes_the_routing_part_of_the_gap(moe_path):
    _, samples = _engine_samples(moe_path)
    gaps = run_distributed(_gaps, 1, args=(moe_path, samples), timeout=300)[0]
    print({k: f"{v:.2e}" for k, v in gaps.items()})
    assert gaps["same"] < 1e-5 and gaps["same_replay"] < 1e-5  # fp32 numerics only
    assert gaps["perturbed"] > 10 * gaps["perturbed_replay"]
    assert gaps["perturbed_replay"] > 10 * gaps["same"]  # the gate weights still come from the perturbed router


def _rollout(path, *, record: bool, replay: bool):
    from megatron_grpo.algo import AdvantageConfig
    from megatron_grpo.data.prompts import EncodedPrompt
    from megatron_grpo.data.records import PromptRecord
    from megatron_grpo.rewards.runner import RewardRunner
    from megatron_grpo.rollout.local import LocalEngine
    from megatron_grpo.rollout.types import SamplingParams
    from megatron_grpo.trainer.rollouts.rollout_phase import RolloutSettings, collect_rollout_batch

    engine = LocalEngine.from_pretrained(path, eos_token_ids=[], seed=0, record_routed_experts=record)
    record_ = PromptRecord(data_source="test", prompt=[{"role": "user", "content": "123"}], ground_truth="321")
    prompts = [EncodedPrompt(record=record_, text="123", input_ids=[5, 6, 7], truncated=False)]
    rewards = RewardRunner("synthetic", num_workers=0, timeout_s=None)
    settings = RolloutSettings(n=2, sampling=SamplingParams(n=2, max_new_tokens=4, seed=1), adv_estimator="grpo",
                               advantage_config=AdvantageConfig(), routing_replay=replay)
    try:
        return collect_rollout_batch(engine, lambda: prompts, engine.tokenizer, rewards, settings, step=1,
                                     num_prompts=1, in_trainer_thread=False).samples
    finally:
        rewards.close()


def test_routes_reach_the_train_samples_only_with_replay(moe_path):
    from megatron_grpo.errors import MegatronGRPOError

    replayed = _rollout(moe_path, record=True, replay=True)
    for sample in replayed:
        assert tuple(sample.routed_experts.shape) == (3 + 4 - 1, 4, 2)
    assert all(s.routed_experts is None for s in _rollout(moe_path, record=True, replay=False))
    with pytest.raises(MegatronGRPOError, match="actor.moe_routing_replay=true but the rollout engine reported no "
                                                "routed experts"):
        _rollout(moe_path, record=False, replay=True)


@pytest.mark.parametrize("own_process", [False, True], ids=["in_process", "own_process"])
def test_the_trainer_engine_records_routes_only_with_replay(moe_path, tmp_path, own_process):
    """build_local_engine passes actor.moe_routing_replay to the engine, in the trainer's process
    or (EngineSpec) in the engine's own: without replay no routes are recorded at all."""
    from megatron_grpo.config import load_config
    from megatron_grpo.rollout.types import GenerationRequest, SamplingParams
    from megatron_grpo.trainer.engines.local_engine import build_local_engine

    request = GenerationRequest(prompt_ids=(5, 6, 7), sampling=SamplingParams(n=1, max_new_tokens=3, seed=1),
                                group_id="0")
    for replay in (True, False):
        cfg = load_config("tiny_cpu", [f"actor.moe_routing_replay={str(replay).lower()}",
                                       f"rollout.local.process={str(own_process).lower()}",
                                       f"logging.output_dir={tmp_path}"])
        engine = build_local_engine(cfg, moe_path, torch.device("cpu"), torch.float32)
        try:
            (sample,) = engine.generate([request])
        finally:
            engine.close()
        if replay:
            assert sample.routed_experts is not None and sample.routed_experts.shape[1:] == (4, 2)
        else:
            assert sample.routed_experts is None


def _with_random_routes(samples, layers: int, experts: int, k: int, dense: tuple[int, ...], seed: int):
    """The samples with engine-layout routes ([length - 1, layers, k], -1 on dense layers) drawn at
    random: far from the trainer's own top-k, so a route replayed for the wrong micro-batch shows."""
    generator = torch.Generator().manual_seed(seed)
    for sample in samples:
        positions = len(sample.prompt_ids) + len(sample.response_ids) - 1
        routes = torch.rand(positions, layers, experts, generator=generator).argsort(dim=-1)[..., :k].int()
        routes[:, list(dense)] = -1
        sample.routed_experts = routes
    return samples


def test_full_recompute_at_pp2_replays_each_micro_batch_its_own_routes(moe_path):
    """Full activation recompute under 1F1B re-runs a micro-batch's routers in its backward, after
    later micro-batches set theirs; each router replays its checkpointed forwards' routes in order
    (models/routing_replay.py). The update at PP2 with full recompute equals the one without."""
    from tests.first_step import first_step, relative_difference, uneven_samples

    samples = _with_random_routes(uneven_samples(12, 250), layers=4, experts=8, k=2, dense=(2,), seed=3)
    parallel = {"pipeline": 2}
    plain, recomputed = (run_distributed(first_step, 2, args=(moe_path, parallel, samples, (), recompute),
                                         timeout=300)[0]
                         for recompute in (None, dict(granularity="full", method="uniform", num_layers=1)))
    assert plain[0]["micro_batches"] > 2  # later micro-batches run forward before earlier backwards
    for key in ("actor/loss", "actor/grad_norm", "actor/pg_loss"):
        assert recomputed[0][key] == pytest.approx(plain[0][key], rel=1e-6, abs=1e-7), key
    worst = max(relative_difference(recomputed[1][name], plain[1][name]) for name in plain[1])
    assert worst < 1e-6, worst
