"""Multi-turn rollouts on the local engine: KV kept between turns vs every turn re-reading its trajectory.

    python benchmarks/bench_multi_turn.py                 # the measured run (both settings below)
    python benchmarks/bench_multi_turn.py --json out.json
    python benchmarks/bench_multi_turn.py --quick         # seconds: a smoke run

The model is the embedded default's (recipes/tiny_cpu.yaml: a Qwen3-shaped 2-layer model, hidden 64,
initialised from trainer.seed, the synthetic tokenizer), on the local engine (fp32, CPU). A round is
what the trainer's multi-turn rollout runs: environments/episodes.run_episodes over 32 prompts x 16
trajectories, every turn one batched generate call continuing each trajectory's ids. The environment
is scripted so every episode runs exactly `turns` turns (each turn its whole token budget, counted
as stopped by its last id; a fixed-length observation after each turn but the last): both modes do
the same work, token for token.
Modes, alternated round by round on the same prompts and seeds:
  kept      every turn but the last asks the engine to keep its KV (GenerationRequest.keep_kv, what
            the trainer sends): the next turn prefills only its new ids;
  reprefill no request keeps anything: every turn prefills its whole trajectory (the engine before).
Measured: the median round time over --repeats rounds per mode (torch threads fixed: 1 by default,
robust on shared CPUs), speedup = reprefill / kept, the tokens the prefills fed, and the peak
resident-set rise during a round (VmHWM reset through /proc/self/clear_refs before it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_grpo.config.loader import load_config  # noqa: E402
from megatron_grpo.data.records import PromptRecord  # noqa: E402
from megatron_grpo.environments.base import Environment, StepResult  # noqa: E402
from megatron_grpo.environments.episodes import ChatRenderer, EpisodeLimits, TurnOutput, run_episodes  # noqa: E402
from megatron_grpo.rollout.local import LocalEngine  # noqa: E402
from megatron_grpo.rollout.types import GenerationRequest, SamplingParams  # noqa: E402
from megatron_grpo.trainer.assembly.initial_model import ensure_initial_model  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny_cpu.yaml"
MODES = ("kept", "reprefill")


@dataclass(frozen=True)
class Setting:
    name: str
    turns: int
    tokens_per_turn: int
    observation_words: int


SETTINGS = (Setting("tiny_cpu_tool-like", turns=3, tokens_per_turn=6, observation_words=3),
            Setting("longer episodes", turns=6, tokens_per_turn=16, observation_words=8))


class ScriptedEnvironment(Environment):
    """Answers every turn with the same observation until the last turn."""

    def __init__(self, turns: int, words: int):
        self.turns, self.observation = turns, " ".join(["1"] * words)
        self.step_count = 0

    def reset(self, record: PromptRecord):
        self.step_count = 0
        return list(record.prompt)

    def step(self, assistant_message: str) -> StepResult:
        self.step_count += 1
        if self.step_count >= self.turns:
            return StepResult(reward=0.0, done=True)
        return StepResult(observations=[{"role": "user", "content": self.observation}])


def build_engine(folder: Path) -> tuple[LocalEngine, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = load_config(RECIPE, [f"logging.output_dir={folder}"])
    ensure_initial_model(cfg, folder / "initial_model")
    model = AutoModelForCausalLM.from_pretrained(folder / "initial_model", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder / "initial_model")
    return LocalEngine(model, tokenizer, eos_token_ids=[]), tokenizer


def one_round(engine, tokenizer, setting: Setting, mode: str, prompts: int, n: int, seed: int) -> dict:
    records = [PromptRecord(data_source="bench", prompt=[{"role": "user", "content": f"{i % 4}{i // 4 % 4}"}],
                            ground_truth="", extra_info={"index": i}) for i in range(prompts) for _ in range(n)]
    limits = EpisodeLimits(max_turns=setting.turns, max_new_tokens_per_turn=setting.tokens_per_turn,
                           max_length=4096, step_timeout_s=60.0)

    def generate(turns):
        requests = [GenerationRequest(t.ids, SamplingParams(max_new_tokens=t.max_new_tokens, ignore_eos=True,
                                                            seed=seed * 1_000_003 + t.episode * 31 + t.turn),
                                      keep_kv=mode == "kept" and t.turn + 1 < setting.turns) for t in turns]
        # every turn runs its whole budget (ignore_eos) and counts as stopped, so no episode ends early
        return [TurnOutput(s.response_ids, s.logprobs, "stop", s.weight_version) for s in engine.generate(requests)]

    # positions the prefill forwards run over (padding included); a decode step feeds one per row
    prefill_positions = []
    hook = engine.model.register_forward_pre_hook(
        lambda _m, _a, kw: prefill_positions.append(kw["input_ids"].numel()) if kw["input_ids"].shape[1] > 1
        else None, with_kwargs=True)
    environments = [ScriptedEnvironment(setting.turns, setting.observation_words) for _ in records]
    Path("/proc/self/clear_refs").write_text("5")  # Linux: resets VmHWM to the current RSS
    rss_before = _rss_bytes("VmRSS")
    start = time.perf_counter()
    try:
        trajectories = run_episodes(records, environments, ChatRenderer(tokenizer), limits, generate)
    finally:
        hook.remove()
    seconds = time.perf_counter() - start
    assert all(t.turns == setting.turns for t in trajectories), "an episode ended early: the modes would differ"
    return {"seconds": seconds, "prefill_positions": sum(prefill_positions),
            "peak_rise_bytes": _rss_bytes("VmHWM") - rss_before,
            "trajectory_tokens": sum(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)}


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not found in /proc/self/status")


def measure(engine, tokenizer, setting: Setting, repeats: int, prompts: int, n: int) -> dict:
    rounds = {mode: [] for mode in MODES}
    for repeat in range(repeats + 1):  # round 0 of each mode warms up and is dropped
        for mode in MODES:
            result = one_round(engine, tokenizer, setting, mode, prompts, n, seed=repeat)
            if repeat:
                rounds[mode].append(result)
    out = {"setting": setting.__dict__, "trajectories": prompts * n}
    for mode in MODES:
        out[mode] = {"median_s": statistics.median(r["seconds"] for r in rounds[mode]),
                     "min_s": min(r["seconds"] for r in rounds[mode]),
                     "prefill_positions": rounds[mode][0]["prefill_positions"],
                     "peak_rise_mib": max(r["peak_rise_bytes"] for r in rounds[mode]) / 2**20,
                     "trajectory_tokens": rounds[mode][0]["trajectory_tokens"]}
    assert out["kept"]["trajectory_tokens"] == out["reprefill"]["trajectory_tokens"]
    out["speedup"] = out["reprefill"]["median_s"] / out["kept"]["median_s"]
    out["tokens_per_s"] = {mode: out[mode]["trajectory_tokens"] / out[mode]["median_s"] for mode in MODES}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="2 repeats of 4 prompts x 4: a smoke run")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts, n, repeats = (4, 4, 2) if args.quick else (32, 16, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        engine, tokenizer = build_engine(Path(tmp))
        results = [measure(engine, tokenizer, s, repeats, prompts, n) for s in SETTINGS]
    print(f"{'setting':<22} {'turns':>5} {'kept s':>8} {'reprefill s':>11} {'speedup':>8} "
          f"{'prefill pos kept/reprefill':>27} {'peak MiB kept/reprefill':>24}")
    for r in results:
        k, p = r["kept"], r["reprefill"]
        print(f"{r['setting']['name']:<22} {r['setting']['turns']:>5} {k['median_s']:>8.3f} {p['median_s']:>11.3f} "
              f"{r['speedup']:>7.2f}x {k['prefill_positions']:>13,} / {p['prefill_positions']:<11,} "
              f"{k['peak_rise_mib']:>10.1f} / {p['peak_rise_mib']:<.1f}")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "threads": args.threads, "repeats": repeats}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
