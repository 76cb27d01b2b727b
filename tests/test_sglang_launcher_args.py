"""The launcher's command lines (rollout/sglang/launcher.py: server_command, router_command) parsed by
SGLang 0.5.23's own parsers: `prepare_server_args` (what `python -m sglang.launch_server` runs before
it starts anything) and sglang-router's `parse_router_args` (what `python -m
sglang_router.launch_router` runs). A keyed command runs launch/api_key_exec.py, the real wrapper,
up to the point where it hands its argv to the module. All commands are parsed in one subprocess of
the runtime venv (this file run as a script); nothing is started."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from megatron_grpo.rollout.sglang.launcher import (API_KEY_VARIABLE, RouterSettings, ServerSettings, router_command,
                                                   server_command)

pytestmark = [pytest.mark.sglang_runtime]

SERVER = ("python", "-m", "sglang.launch_server")
ROUTER = ("python", "-m", "sglang_router.launch_router")

# Every setting away from its default, and the ServerArgs field each one must land in.
EVERYTHING = ServerSettings(
    model_path="/models/qwen3", tokenizer_path="/models/qwen3-tokenizer", tp_size=2, mem_fraction_static=0.55,
    host="127.0.0.2", port=31234, api_key="key-with-=and-spaces ok", enable_memory_saver=True, base_gpu_id=3,
    enable_deterministic_inference=True, enable_fp32_lm_head=True, enable_return_routed_experts=True,
    device="cpu", dtype="bfloat16", max_total_tokens=8192,
    extra_args=("--skip-server-warmup", "--nccl-port", "23456", "--disable-overlap-schedule", "--log-level", "warning"),
    command=SERVER)
EXPECTED_FIELDS = {
    "model_path": "/models/qwen3", "tokenizer_path": "/models/qwen3-tokenizer", "tp_size": 2,
    "mem_fraction_static": 0.55, "host": "127.0.0.2", "port": 31234, "api_key": "key-with-=and-spaces ok",
    "enable_memory_saver": True, "base_gpu_id": 3, "enable_deterministic_inference": True,
    "enable_fp32_lm_head": True, "enable_return_routed_experts": True, "device": "cpu", "dtype": "bfloat16",
    "max_total_tokens": 8192,
    "sleep_on_idle": True,  # device=cpu: the scheduler must not spin beside the trainer
    # extra_args, untouched
    "skip_server_warmup": True, "nccl_port": 23456, "disable_overlap_schedule": True, "log_level": "warning",
}
# ServerSettings' fields that are no flag: extra_args are checked through the fields above, command
# through the module that parses them.
NOT_FLAGS = {"extra_args", "command", "cpu_threads"}  # cpu_threads: OMP_NUM_THREADS (tests/test_cpu_engines.py)

ROUTER_SETTINGS = RouterSettings(host="127.0.0.3", port=31300, policy="cache_aware", api_key="router key",
                                 extra_args=("--prometheus-port", "31301"), command=ROUTER)
WORKERS = ("http://127.0.0.1:31234", "http://127.0.0.1:31235")


@pytest.fixture(scope="module")
def parsed() -> dict[str, dict]:
    """name -> what SGLang's parser made of the command: {"module", "fields", "wrapper"}."""
    from tests.sglang_runtime_fixtures import REPO_ROOT, real_server_settings, runtime_python

    python = runtime_python()
    commands = {
        "everything": (server_command(EVERYTHING), EVERYTHING.api_key),
        "defaults": (server_command(ServerSettings(model_path="/models/qwen3", command=SERVER)), None),
        "sglang alone": ([*SERVER, "--model-path", "/models/qwen3"], None),
        "real cpu engine": (server_command(real_server_settings("/models/qwen3")), None),
        "router": (router_command(ROUTER_SETTINGS, WORKERS), ROUTER_SETTINGS.api_key),
    }
    done = subprocess.run([python, __file__], input=json.dumps(commands), capture_output=True, text=True,
                          timeout=300, cwd=REPO_ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, f"the parsing script failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_server_flag_lands_in_its_server_args_field(parsed):
    assert {f.name for f in dataclasses.fields(ServerSettings)} - NOT_FLAGS <= set(EXPECTED_FIELDS), \
        "a ServerSettings field this test does not check"
    got = parsed["everything"]
    assert got["module"] == "sglang.launch_server"
    assert {name: got["fields"][name] for name in EXPECTED_FIELDS} == EXPECTED_FIELDS
    # the key reached SGLang through the wrapper only: not on the command line, not left in the environment
    assert EVERYTHING.api_key not in " ".join(server_command(EVERYTHING))
    assert got["wrapper"] == {"key_left_in_environment": False, "run_name": "__main__", "alter_sys": True}


def test_default_settings_leave_sglang_at_its_defaults(parsed):
    """ServerSettings' defaults give the same ServerArgs as `--model-path` alone (device and dtype
    included): the launcher decides nothing it is not told to. The flags it always passes (--tp-size,
    --host, --port) default to SGLang's own values (1, 127.0.0.1, 30000)."""
    defaults, alone = parsed["defaults"]["fields"], parsed["sglang alone"]["fields"]
    assert len(alone) > 100 and defaults.keys() == alone.keys()
    assert {name: (defaults[name], alone[name]) for name in alone if defaults[name] != alone[name]} == {}
    assert (defaults["tp_size"], defaults["host"], defaults["port"]) == (1, "127.0.0.1", 30000)
    assert defaults["api_key"] is None and parsed["defaults"]["wrapper"] is None


def test_the_tests_real_cpu_engines_are_parsed_as_meant(parsed):
    fields = parsed["real cpu engine"]["fields"]
    assert (fields["device"], fields["dtype"], fields["max_total_tokens"], fields["skip_server_warmup"],
            fields["sleep_on_idle"]) == ("cpu", "float32", 4096, True, True)
    assert isinstance(fields["nccl_port"], int) and fields["nccl_port"] != fields["port"]


def test_router_flags_land_in_its_router_args(parsed):
    got = parsed["router"]
    assert got["module"] == "sglang_router.launch_router"
    assert {name: got["fields"][name] for name in ("host", "port", "policy", "worker_urls", "api_key",
                                                   "prometheus_port")} == {
        "host": "127.0.0.3", "port": 31300, "policy": "cache_aware", "worker_urls": list(WORKERS),
        "api_key": "router key", "prometheus_port": 31301}
    assert ROUTER_SETTINGS.api_key not in " ".join(router_command(ROUTER_SETTINGS, WORKERS))
    assert got["wrapper"]["key_left_in_environment"] is False


# ------------------------------------------------------------------ the parsing (runtime venv)

def _through_wrapper(args: list[str], api_key: str) -> tuple[str, list[str], dict]:
    """Runs launch/api_key_exec.py's main with the key in its variable, up to runpy.run_module:
    the module it would run, the argv that module would parse, and how it would run it."""
    import runpy

    from megatron_grpo.launch import api_key_exec

    seen = {}

    def run_module(module, run_name=None, alter_sys=False):
        seen.update(module=module, argv=list(sys.argv[1:]), run_name=run_name, alter_sys=alter_sys,
                    key_left_in_environment=API_KEY_VARIABLE in os.environ)

    saved_argv, saved_run = sys.argv, runpy.run_module
    os.environ[API_KEY_VARIABLE] = api_key
    runpy.run_module = run_module
    try:
        api_key_exec.main(args)
    finally:
        sys.argv, runpy.run_module = saved_argv, saved_run
        os.environ.pop(API_KEY_VARIABLE, None)
    return seen.pop("module"), seen.pop("argv"), seen


def _parse(command: list[str], api_key: str | None) -> dict:
    at = max(i for i, part in enumerate(command[:-1]) if part == "-m") + 1  # as launcher.keyed_command
    module, args, wrapper = command[at], command[at + 1:], None
    if module == "megatron_grpo.launch.api_key_exec":
        module, args, wrapper = _through_wrapper(args, api_key)
    if module == "sglang.launch_server":
        from sglang.srt.server_args import prepare_server_args, record_fields

        server_args = prepare_server_args(args)
        fields = {field.name: getattr(server_args, field.name) for field in record_fields(type(server_args))}
    elif module == "sglang_router.launch_router":
        from sglang_router.launch_router import parse_router_args

        router_args = parse_router_args(args)
        router_args._validate_router_args()  # what launch_router checks before it starts the router
        fields = dataclasses.asdict(router_args)
    else:
        raise ValueError(f"no parser for {module}")
    return {"module": module, "fields": fields, "wrapper": wrapper}


def main() -> None:
    commands = json.load(sys.stdin)
    result = {name: _parse(command, key) for name, (command, key) in commands.items()}
    print(json.dumps(result, default=repr))


if __name__ == "__main__":
    main()
