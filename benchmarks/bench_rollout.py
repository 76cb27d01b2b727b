"""Rollout throughput on CPU, against SGLang 0.5.23's own server code (tests/sglang_harness, needs
build/sglang-venv: scripts/setup_sglang_venv.sh) and the real sglang-router: the SGLang client before
this change (the thread-pool client of git revision BEFORE, loaded from git) against the current one,
side by side in one run.

  inflight  4 engines, max_concurrency=64, one step of 64 groups x 8 seeded samples (one request
            each): sequences each engine holds (its own GET /v1/loads, polled every 20 ms), directly
            and through the router. Target: each engine holds its 64 while work remains.
  client    2 engines that answer at once (HARNESS_INSTANT): requests/s one client process sustains at
            256, 1024 and 4096 requests in flight, with that process's threads and peak RSS.
  rewards   2 engines and a reward function that takes 20 ms a call (a verifier; 2 workers): one
            rollout round (trainer/rollouts/rollout_phase.py) scoring groups as they finish vs after
            the last one: time from the first / last finished group to its reward, and the share of
            the round spent scoring after generation.

    python benchmarks/bench_rollout.py --out build/bench_rollout [--sections inflight client rewards]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEFORE = "1f90f90"  # the last revision with the thread-pool client (one pool over all servers)
VERIFIER_S = 0.02


def slow_verifier(prompt, response, ground_truth, extra):
    """The rewards section's reward function (loaded by path in the reward workers)."""
    time.sleep(VERIFIER_S)
    return float(len(response) % 2)


def old_client_class(folder: Path):
    """SGLangClient as of BEFORE, imported from its source at that revision."""
    import importlib.util

    source = subprocess.run(["git", "show", f"{BEFORE}:megatron_grpo/rollout/sglang/client.py"], cwd=REPO,
                            check=True, capture_output=True, text=True).stdout
    path = folder / "client_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("client_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SGLangClient


def get_json(url: str, path: str):
    import urllib.request

    with urllib.request.urlopen(url + path, timeout=30) as answer:
        return json.loads(answer.read())


def engines(folder: Path, count: int, faults: dict, router: bool = False):
    from tests.sglang_harness.fixtures import launch_servers, router_settings, server_settings
    from tests.tiny_hf import save_tiny_model

    model = save_tiny_model(folder / "model", seed=0)
    settings = [server_settings(model) for _ in range(count)]
    launcher = launch_servers(folder / "logs", settings, faults=faults,
                              router=router_settings("round_robin") if router else None)
    return launcher, [s.url for s in settings], (launcher.router.url if router else None)


# ----- inflight ------------------------------------------------------------------------------------
def inflight(folder: Path, quick: bool) -> dict:
    from megatron_grpo.rollout.sglang.client import SGLangClient
    from megatron_grpo.rollout.types import GenerationRequest, SamplingParams

    count, per_engine, groups, n = (2, 8, 8, 4) if quick else (4, 64, 64, 8)
    launcher, urls, router_url = engines(folder, count, {"HARNESS_FORWARD_DELAY_S": "0.002"}, router=True)
    Before = old_client_class(folder)
    requests = [GenerationRequest(prompt_ids=[5, 9, 11, 3 + i % 50], group_id=str(i),
                                  sampling=SamplingParams(n=n, max_new_tokens=8, ignore_eos=True, seed=i))
                for i in range(groups)]
    clients = {
        "before, direct": lambda: Before(urls, concurrency=per_engine),
        "before, router": lambda: Before([router_url], concurrency=per_engine),
        "after, direct": lambda: SGLangClient(urls, concurrency=per_engine),
        "after, router": lambda: SGLangClient([router_url], concurrency=per_engine, engines_per_url=count),
    }
    rows = {}
    try:
        for name, make in clients.items():
            client = make()
            polls: list[list[int]] = []
            worker = threading.Thread(target=client.generate, args=(requests,))
            start = time.perf_counter()
            worker.start()
            while worker.is_alive():
                polls.append([sum(x["num_running_reqs"] + x["num_waiting_reqs"]
                                  for x in get_json(u, "/v1/loads")["loads"]) for u in urls])
                time.sleep(0.02)
            worker.join()
            wall = time.perf_counter() - start
            client.close()
            first_half = polls[: max(1, len(polls) // 2)]  # work certainly remains
            rows[name] = {"mean_per_engine_first_half": [round(sum(p[i] for p in first_half) / len(first_half), 1)
                                                         for i in range(count)],
                          "peak_per_engine": [max(p[i] for p in polls) for i in range(count)],
                          "wall_s": round(wall, 2), "polls": len(polls)}
            print(f"inflight {name}: {rows[name]}", flush=True)
    finally:
        launcher.shutdown(grace_s=5)
    return {"engines": count, "max_concurrency": per_engine, "sequences": groups * n, "rows": rows}


# ----- client ----------------------------------------------------------------------------------------
CLIENT_RUN = r"""
import json, sys, threading, time, psutil
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from benchmarks.bench_rollout import old_client_class
from megatron_grpo.rollout.sglang.client import SGLangClient
from megatron_grpo.rollout.types import GenerationRequest, SamplingParams
which, urls, in_flight, total = sys.argv[2], sys.argv[3].split(","), int(sys.argv[4]), int(sys.argv[5])
if which == "before":
    client = old_client_class(Path(sys.argv[6]))(urls, concurrency=in_flight)
else:
    client = SGLangClient(urls, concurrency=in_flight // len(urls))
requests = [GenerationRequest(prompt_ids=[5, 9, 11], group_id=str(i), sampling=SamplingParams(max_new_tokens=4))
            for i in range(total)]
process, peak = psutil.Process(), {"threads": 0, "rss": 0}
done = threading.Event()
def watch():
    while not done.is_set():
        peak["threads"] = max(peak["threads"], process.num_threads())
        peak["rss"] = max(peak["rss"], process.memory_info().rss)
        time.sleep(0.05)
threading.Thread(target=watch, daemon=True).start()
client.generate(requests[:len(urls) * 4])  # connections and imports warm
start = time.perf_counter()
samples = client.generate(requests)
wall = time.perf_counter() - start
done.set()
assert len(samples) == total and all(s.finish_reason != "abort" for s in samples)
print(json.dumps({"requests_per_s": total / wall, "threads": peak["threads"], "rss_mib": peak["rss"] / 2**20}))
"""


def client(folder: Path, quick: bool) -> dict:
    levels = (64, 256) if quick else (256, 1024, 4096)
    launcher, urls, _ = engines(folder, 2, {"HARNESS_INSTANT": "1"})
    rows = {}
    try:
        for in_flight in levels:
            total = max(2 * in_flight, 512)
            for which in ("before", "after"):
                out = subprocess.run([sys.executable, "-c", CLIENT_RUN, str(REPO), which, ",".join(urls),
                                      str(in_flight), str(total), str(folder)],
                                     cwd=REPO, capture_output=True, text=True, timeout=900)
                if out.returncode != 0:
                    raise RuntimeError(f"client run {which} {in_flight}: {out.stderr[-2000:]}")
                rows[f"{which} {in_flight}"] = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"client {which} at {in_flight} in flight: {rows[f'{which} {in_flight}']}", flush=True)
    finally:
        launcher.shutdown(grace_s=5)
    return {"engines": 2, "rows": rows}


# ----- rewards ---------------------------------------------------------------------------------------
def rewards(folder: Path, quick: bool) -> dict:
    import dataclasses

    from megatron_grpo.algo import AdvantageConfig
    from megatron_grpo.data.prompts import EncodedPrompt
    from megatron_grpo.data.records import PromptRecord
    from megatron_grpo.rewards.runner import RewardRunner
    from megatron_grpo.rollout.sglang.client import SGLangClient
    from megatron_grpo.rollout.types import SamplingParams
    from megatron_grpo.trainer.rollouts.rollout_phase import RolloutSettings, _single_turn_round
    from tests.tiny_hf import char_tokenizer

    groups, n = (8, 4) if quick else (32, 8)
    launcher, urls, _ = engines(folder, 2, {"HARNESS_FORWARD_DELAY_S": "0.002"})
    tokenizer = char_tokenizer()
    prompts = [EncodedPrompt(PromptRecord("bench", [{"role": "user", "content": "x"}], "1"), f"p{i}",
                             [5, 9, 11, 3 + i], False) for i in range(groups)]
    base = RolloutSettings(n=n, sampling=SamplingParams(n=n, max_new_tokens=12, seed=1), adv_estimator="grpo",
                           advantage_config=AdvantageConfig())
    rows = {}
    try:
        with RewardRunner(f"{Path(__file__).resolve()}:slow_verifier", num_workers=2, timeout_s=30) as runner:
            client_ = SGLangClient(urls, concurrency=16)
            for name, overlap in (("after the last group", False), ("as groups finish", True)):
                settings = dataclasses.replace(base, score_while_generating=overlap)
                timings = {"time/rollout": 0.0, "time/reward": 0.0}
                _, scores, metrics = _single_turn_round(client_, prompts, tokenizer, runner, settings, 1, 1, timings,
                                                        in_trainer_thread=False)
                step = timings["time/rollout"] + timings["time/reward"]
                rows[name] = {"rollout_s": round(timings["time/rollout"], 2),
                              "reward_tail_s": round(timings["time/reward"], 2),
                              "reward_share": round(timings["time/reward"] / step, 3),
                              "first_group_to_reward_s": metrics.get("reward/first_latency_s"),
                              "last_group_to_reward_s": metrics.get("reward/last_latency_s"),
                              "scores": round(sum(scores), 3)}
                print(f"rewards {name}: {rows[name]}", flush=True)
            client_.close()
    finally:
        launcher.shutdown(grace_s=5)
    return {"groups": groups, "n": n, "verifier_s": VERIFIER_S, "reward_workers": 2, "rows": rows}


SECTIONS = {"inflight": inflight, "client": client, "rewards": rewards}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "build" / "bench_rollout")
    parser.add_argument("--sections", nargs="+", choices=sorted(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    results = {}
    for name in args.sections:
        folder = args.out / name
        folder.mkdir(exist_ok=True)
        results[name] = SECTIONS[name](folder, args.quick)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
