"""The trainer with rollout.engine=sglang against SGLang's own server code (tests/sglang_harness):
servers it launches itself (with the real sglang-router in front) or given by URL, every weight
transport, and engine faults: a launched engine killed at random moments is restarted and caught
up, and all engines dying stops the run after a checkpoint."""
import json
import os
import random
import signal
import threading
import time

import psutil
import pytest

from megatron_grpo.launch.env import free_server_port
from megatron_grpo.testing.distributed import DistributedChildError, free_port, run_distributed
from megatron_grpo.rollout.sglang.http_json import request_json
from megatron_grpo.rollout.sglang.launcher import API_KEY_VARIABLE, SGLangLauncher
from tests.sglang_harness.fixtures import harness_env, launch_servers, server_settings, trainer_overrides

pytestmark = pytest.mark.slow  # starts SGLang test servers


def _train(rank, world_size, overrides):
    from megatron_grpo.config import load_config
    from megatron_grpo.trainer.loop import train

    cfg = load_config("tiny_cpu", overrides)
    train(cfg)
    with open(f"{cfg.logging.output_dir}/metrics.jsonl") as handle:
        return [json.loads(line) for line in handle] if rank == 0 else None


def _model_info(url, api_key=None):
    return request_json(url, "/model_info", method="GET", timeout_s=30, api_key=api_key)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    from megatron_grpo.data.synthetic import build_tokenizer
    from megatron_grpo.models.tiny import save_tiny_hf_model

    folder = tmp_path_factory.mktemp("policy") / "qwen3"
    save_tiny_hf_model("qwen3", folder, seed=0, num_hidden_layers=2)
    build_tokenizer(folder)
    return folder


@pytest.fixture
def harness_environment(monkeypatch):
    """What the servers the trainer launches need (they inherit the trainer's environment)."""
    for key, value in harness_env().items():
        monkeypatch.setenv(key, value)


def base_overrides(policy_dir, output_dir, steps: int):
    return [f"model.path={policy_dir}", "model.make_vocab_size_divisible_by=8", "rollout.engine=sglang",
            f"trainer.total_steps={steps}", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4",
            f"logging.output_dir={output_dir}", "logging.console=false", "logging.plot=false", "eval.interval=-1",
            "actor.optim.lr=1e-2", "rollout.sglang.health_check_interval_s=2"]


def assert_on_policy_steps(records, steps: int) -> None:
    """Every step ran once, in order, sampled by the weights of the step before, and the engines'
    log-probs equal the trainer's recomputation (they would not after a missed sync)."""
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for record in records:
        assert record["rollout/weight_version_min"] == record["rollout/weight_version_max"] == record["step"] - 1
        assert record["actor/logprob_abs_diff_max"] < 1e-4, record["actor/logprob_abs_diff_max"]


def test_trainer_launches_servers_and_router_distributed_sync(tmp_path, policy_dir, harness_environment):
    """Launched engines behind a launched router; distributed (gloo broadcast) weight sync."""
    run = tmp_path / "run"
    overrides = base_overrides(policy_dir, run, 2) + trainer_overrides() + [
        "rollout.sglang.num_engines=2", f"rollout.sglang.port={free_server_port(count=2)}",
        "rollout.sglang.router=true",
        f"rollout.sglang.router_port={free_server_port()}", "rollout.sglang.router_policy=round_robin",
        "rollout.sglang.weight_sync=distributed"]
    records = run_distributed(_train, 2, (overrides,), timeout=900)[0]
    assert_on_policy_steps(records, 2)
    # the first sync is verified by checksums predicted from the trainer's tensors (by value it cannot
    # be: SGLang's Qwen3 has no get_weights_by_name): every served parameter, on both engines
    first = records[0]
    assert first["sync/verified"] == 1.0 and first["sync/verified_tensors"] > 0
    assert first["sync/checksums_verified"] >= 2 * first["sync/verified_tensors"], first
    logs = sorted((run / "sglang_logs").glob("sglang-*.log"))
    commands = [log.read_text(errors="replace").splitlines()[0] for log in logs]
    engine_commands = [c for c in commands if "sglang_harness.server" in c]
    assert len(engine_commands) == 2 and all("--enable-deterministic-inference" in c for c in engine_commands)
    router_commands = [c for c in commands if "sglang_router.launch_router" in c]
    assert len(router_commands) == 1
    # every process got the run's key, from its environment: none on a command line
    keyed = f"-m megatron_grpo.launch.api_key_exec {API_KEY_VARIABLE} "
    assert all(keyed in c and "--api-key" not in c for c in engine_commands + router_commands), commands


GIVEN_KEY_VARIABLE, GIVEN_KEY = "TEST_GIVEN_SERVERS_KEY", "given-servers-key"


@pytest.fixture(scope="module")
def given_servers(policy_dir, tmp_path_factory):
    """A server started by someone else, with a key; the trainer ranks read it from the variable
    rollout.sglang.api_key_env names."""
    launcher = launch_servers(tmp_path_factory.mktemp("logs"), [server_settings(policy_dir, api_key=GIVEN_KEY)])
    yield [server.url for server in launcher.servers]
    launcher.shutdown(grace_s=2)


# Disk sync runs against SGLang's own runtime in the cluster lane: a trainer's, into the engine it
# launched (tests/test_sglang_runtime_e2e.py, bf16); the transport's, into two given engines
# (tests/test_sglang_runtime.py).
@pytest.mark.parametrize("transport", ["tensor"])
def test_trainer_drives_servers_given_by_url(tmp_path, policy_dir, given_servers, transport):
    urls = given_servers  # tensor: colocated, one engine
    records = run_distributed(_train, 2, (base_overrides(policy_dir, tmp_path / "run", 3) + [
        f"rollout.sglang.urls=[{','.join(urls)}]", f"rollout.sglang.weight_sync={transport}",
        f"rollout.sglang.api_key_env={GIVEN_KEY_VARIABLE}"],), timeout=600,
                              env={GIVEN_KEY_VARIABLE: GIVEN_KEY})[0]
    assert_on_policy_steps(records, 3)
    assert any(r["actor/grad_norm"] > 0 for r in records)  # the policy moved: the syncs carried news
    versions = [str(_model_info(url, GIVEN_KEY)["weight_version"]) for url in urls]
    assert versions == ["3"] * len(urls)  # a string in SGLang


def test_servers_given_by_url_get_the_start_weights_whatever_they_loaded(tmp_path, policy_dir):
    """A fresh server started on policy_dir; the run starts from another checkpoint. The server
    reports weight version 0 either way, so only a push before step 1 makes step 1 on-policy
    (without it the engine's log-probs were 0.5 off the trainer's)."""
    from megatron_grpo.data.synthetic import build_tokenizer
    from megatron_grpo.models.tiny import save_tiny_hf_model

    other = save_tiny_hf_model("qwen3", tmp_path / "other", seed=1, num_hidden_layers=2)
    build_tokenizer(other)
    launcher = launch_servers(tmp_path / "logs", [server_settings(policy_dir)])
    try:
        url = launcher.servers[0].url
        assert str(_model_info(url)["weight_version"]) == "default"  # SGLang's version 0
        records = run_distributed(_train, 1, (base_overrides(other, tmp_path / "run", 1) + [
            f"rollout.sglang.urls=[{url}]", "rollout.sglang.weight_sync=disk"],), timeout=600)[0]
        assert_on_policy_steps(records, 1)
    finally:
        launcher.shutdown(grace_s=2)


def test_unreachable_server_names_the_url(tmp_path, policy_dir):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(DistributedChildError, match=url.replace(".", r"\.")):
        run_distributed(_train, 1, ([f"model.path={policy_dir}", "model.make_vocab_size_divisible_by=8",
                                     "rollout.engine=sglang", f"rollout.sglang.urls=[{url}]",
                                     "rollout.sglang.weight_sync=disk", "rollout.sglang.max_retries=0",
                                     f"logging.output_dir={tmp_path}", "logging.console=false"],), timeout=300)


def test_weight_update_group_fails_early_for_a_dead_url_and_says_what_it_waits_for(monkeypatch, caplog):
    """With nothing listening at an engine's URL, /init_weights_update_group failed at once, yet
    the trainer waited rollout.sglang.weight_update_timeout_s (600 s) for that engine to join the
    group, in silence. Now the failed request ends the join at once, naming the URL; an engine that
    takes the request and never joins is named after a few seconds, and the join ends at the
    timeout. In-process, gloo, no SGLang server (what build_sglang_engine and the stage senders call)."""
    import http.server
    import logging

    from megatron_grpo.rollout.sglang import weight_sync
    from megatron_grpo.rollout.sglang.client import SGLangClient
    from megatron_grpo.rollout.sglang.errors import SGLangError
    from megatron_grpo.rollout.sglang.http_json import RetryPolicy

    def join(url: str, timeout_s: float) -> float:
        client = SGLangClient([url], retry=RetryPolicy(max_attempts=1))
        transport = weight_sync.DistributedTransport(client, [weight_sync.EngineTarget(url)], "127.0.0.1", 0,
                                                     backend="gloo", timeout_s=timeout_s)
        start = time.monotonic()
        try:
            with pytest.raises(SGLangError, match=url.replace(".", r"\.")):
                transport.connect()
        finally:
            client.close()
        return time.monotonic() - start

    dead = f"http://127.0.0.1:{free_port()}"
    assert join(dead, timeout_s=60) < 10  # not the 60 s timeout: the engine's request failed

    released = threading.Event()

    class NeverJoins(http.server.BaseHTTPRequestHandler):  # takes /init_weights_update_group, then nothing
        def do_POST(self):  # noqa: N802 - http.server's name
            released.wait(30)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NeverJoins)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    silent = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setitem(weight_sync.JOIN_NOTICE_S, "first_s", 0.3)
    try:
        with caplog.at_level(logging.WARNING, logger=weight_sync.__name__):
            assert 2.0 <= join(silent, timeout_s=2.0) < 10
    finally:
        released.set()
        server.shutdown()
    [said, *_] = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
    assert f"waiting for {silent} to join (1 engine rank);" in said and "gives up after 2 s" in said


def _server_groups(port: int, count: int) -> list[int]:
    """Process-group ids of the launched servers listening on port, port + 1, ..."""
    groups = {}
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port in range(port, port + count) and conn.pid:
            groups[conn.laddr.port] = os.getpgid(conn.pid)
    return [groups[p] for p in sorted(groups)]


@pytest.mark.timeout(1500)  # each restart is an SGLang start: ~20 s idle, minutes on a loaded machine
def test_launched_engine_killed_at_random_moments_is_restarted(tmp_path, policy_dir, harness_environment,
                                                               monkeypatch):
    """Kill one of two launched engines (SIGKILL to all its processes) at a random moment
    somewhere in a step (rollout, training or weight sync): its unfinished requests are retried on
    the other engine, it is restarted at the next sync (a sync it broke is pushed again) and gets
    the current weights; the run finishes with every step once and every sample drawn by the
    previous step's weights. (Each kill costs an engine restart, ~20 s idle, a minute under load:
    one kill per CI run keeps the suite in its budget; FAULT_TEST_KILLS=2 and FAULT_TEST_SEED pick
    more and other moments.)"""
    monkeypatch.setenv("HARNESS_FORWARD_DELAY_S", "0.003")  # rollouts take long enough to be hit
    # one kill per step from step 2 on, and 2 steps more than kills, so that a kill that lands a
    # step late (a loaded machine) is still followed by a sync that restarts the engine
    kills = int(os.environ.get("FAULT_TEST_KILLS", "1"))
    run, port, steps = tmp_path / "run", free_server_port(count=2), kills + 3
    overrides = base_overrides(policy_dir, run, steps) + trainer_overrides() + [
        "rollout.sglang.num_engines=2", f"rollout.sglang.port={port}", "rollout.sglang.weight_sync=distributed",
        "rollout.sglang.max_retries=4", "data.max_response_length=16"]
    rng = random.Random(int(os.environ.get("FAULT_TEST_SEED", "0")))  # the note reports seeds 0-4
    done, killed = threading.Event(), []

    def logged() -> int:
        metrics = run / "metrics.jsonl"
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    def killer():
        while len(killed) < kills and not done.is_set():
            groups = _server_groups(port, 2)
            if len(groups) == 2 and logged() > len(killed):  # one kill per step, from step 2 on
                # at a random moment, but before the step after next is logged: a sync must follow
                # the kill (steps of ~0.5 s once let a 2 s delay land after the last one)
                moment = time.monotonic() + rng.uniform(0.1, 2.0)
                while time.monotonic() < moment and logged() < len(killed) + 2:
                    time.sleep(0.02)
                group = rng.choice(groups)
                os.killpg(group, signal.SIGKILL)
                killed.append(group)
            time.sleep(0.1)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        records = run_distributed(_train, 1, (overrides,), timeout=1500)[0]
    finally:
        done.set()
        thread.join(timeout=10)
    assert len(killed) == kills
    assert_on_policy_steps(records, steps)
    assert records[-1]["sync/engine_restarts"] >= kills


def test_engines_given_by_url_dying_one_then_the_last(tmp_path, policy_dir):
    """Two engines given by URL, min_engines=1. Engine B is SIGKILLed once step 1 is logged: it
    leaves the rotation (it was not launched by this trainer, so it stays out) and
    step 2 runs on A alone, with A's log-probs those of the trainer's step-1 weights. A then dies in
    step 3 (its scheduler exits at its 49th /generate request: the least-loaded client gives A
    half of step 1's 8 prompts x 4 samples, 32-48 by the end of step 2, whatever B answered
    before it died): below
    min_engines, every rank stops with the rollout error naming A, after checkpointing step 2."""
    run = tmp_path / "run"
    doomed_last = SGLangLauncher(servers=[server_settings(policy_dir)], log_dir=tmp_path / "logs-a",
                                 env=harness_env({"HARNESS_DIE_ON_GENERATE": "49"}))
    doomed_last.start()  # starts while B's launcher waits for B
    doomed_first = launch_servers(tmp_path / "logs-b", [server_settings(policy_dir)])
    try:
        doomed_last.wait_healthy(timeout_s=300, poll_s=0.5)
        url_a, url_b = doomed_last.servers[0].url, doomed_first.servers[0].url

        def kill_b_after_step_1():
            metrics = run / "metrics.jsonl"
            while not (metrics.exists() and metrics.read_text().strip()):
                time.sleep(0.2)
            os.killpg(doomed_first.processes[0].process.pid, signal.SIGKILL)

        threading.Thread(target=kill_b_after_step_1, daemon=True).start()
        with pytest.raises(DistributedChildError) as failure:
            run_distributed(_train, 2, (base_overrides(policy_dir, run, 4) + [
                f"rollout.sglang.urls=[{url_a},{url_b}]", "rollout.sglang.weight_sync=distributed",
                "rollout.sglang.min_engines=1", "rollout.sglang.max_retries=1"],), timeout=600)
        message = str(failure.value)
        assert "RolloutFailure" in message and url_a in message, message
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert_on_policy_steps(records, 2)
        assert (run / "checkpoints" / "step_2" / "complete.json").is_file()
        assert not (run / "checkpoints" / "step_3").exists()
    finally:
        doomed_last.shutdown(grace_s=2)
        doomed_first.shutdown(grace_s=2)


SKIPPED = "model.layers.1.mlp.down_proj.weight"


def test_replay_through_sglang_and_a_tensor_the_engine_skips(tmp_path, policy_dir):
    """One Qwen3 engine given by URL, sampling with top-p 0.9 / top-k 20 and sampling replay: the
    supports and behaviour log-probs come from SGLang's own sampler through return_sampling_mask.
    The engine skips one pushed tensor without a word (HARNESS_SKIP_WEIGHT; SGLang's Qwen3 skips a
    name it does not know so, and has no /get_weights_by_name: no value check can run with one
    engine, and checksums have no second engine to disagree with). What catches it: the preflight's
    weight round trip (the run stops before step 1), and without a preflight the mismatch health
    of the first step after an update."""
    launcher = launch_servers(tmp_path / "logs", [server_settings(policy_dir)], faults={"HARNESS_SKIP_WEIGHT": SKIPPED})
    try:
        url = launcher.servers[0].url
        replay = [f"rollout.sglang.urls=[{url}]", "rollout.sglang.weight_sync=disk", "rollout.top_p=0.9",
                  "rollout.top_k=20"]
        with pytest.raises(DistributedChildError) as stopped:
            run_distributed(_train, 1, (base_overrides(policy_dir, tmp_path / "preflight", 1) + replay + [
                "trainer.preflight=true", "trainer.preflight_rounds=2"],), timeout=600)
        message = str(stopped.value)
        assert "PreflightFailed: preflight failed (weight round trip;" in message, message[-3000:]
        assert not (tmp_path / "preflight" / "metrics.jsonl").exists()

        records = run_distributed(_train, 1, (base_overrides(policy_dir, tmp_path / "run", 2) + replay,),
                                  timeout=600)[0]
    finally:
        launcher.shutdown(grace_s=2)
    first, second = records
    # step 1: the engine holds the start weights (the skipped tensor too): with replay the engine's
    # truncated log-probs and the trainer's agree to fp32 rounding (without it, ~0.1 apart)
    assert first["mismatch/abs_logp_diff_max"] < 1e-5 and first["mismatch/tokens"] > 0
    assert all(r.get("sync/verified_tensors", 0) == 0 for r in records)  # no value check could run
    # step 2: every tensor moved but the skipped one: the mismatch jumps far past any rounding
    assert second["mismatch/abs_logp_diff_p99"] > 1e-3, second["mismatch/abs_logp_diff_p99"]
