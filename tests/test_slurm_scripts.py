"""Static checks of the cluster launch scripts: shellcheck / bash -n, #SBATCH headers, the GPU
recipes against their layouts, and DRY_RUN=1 plans of the 8B (colocated), 70B, 30B-A3B and
GLM-4.5-Air (dedicated) scripts: task counts, GPU binding, engine placement. No Slurm needed (the
plan is computed for a synthetic allocation node1..N)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.requirements import require_executable

REPO = Path(__file__).resolve().parents[1]
GPU_SCRIPTS = {  # script -> (recipe, nodes)
    "grpo_qwen3_8b.sh": ("qwen3_8b_gsm8k", 1),
    "grpo_qwen3_32b.sh": ("qwen3_32b_math", 4),
    "grpo_llama3_70b.sh": ("llama3_70b_gsm8k", 8),
    "grpo_qwen3_30b_a3b.sh": ("qwen3_30b_a3b_gsm8k", 4),
    "grpo_glm45_air.sh": ("glm45_air_gsm8k", 6),
}
SHELL_FILES = sorted([*REPO.glob("slurm/*.sh"), *REPO.glob("slurm/lib/*.sh"),
                      REPO / "scripts/start_local_slurm.sh", REPO / "scripts/stop_local_slurm.sh",
                      REPO / "scripts/install_test_deps.sh", REPO / "scripts/lock_cluster_env.sh",
                      REPO / "docker/install.sh"])


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without Slurm / launcher variables (pytest may itself run
    inside an allocation), with the venv's python first on PATH."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "OMPI_", "PMI")) and k not in (
               "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "TASKS_PER_NODE",
               "ENGINE_PLACEMENT", "HF_MODEL", "TRAIN_FILES", "VAL_FILES", "GRPO_RUN_DIR", "DRY_RUN")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def dry_run(script: str, *overrides: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "slurm" / script), *overrides], cwd=REPO, text=True,
                          capture_output=True, timeout=120,
                          env=clean_env(DRY_RUN="1", GRPO_NET_IFNAME="ib0", **env))


def parse_plan(stdout: str) -> dict[str, list[dict[str, str]]]:
    """`[dry-run] node=H role=R k=v ... :: command` lines -> {role: [{node, ..., cmd}]}."""
    plan: dict[str, list[dict[str, str]]] = {"engine": [], "trainer": [], "router": [], "launch": [],
                                             "reward_model": []}
    for line in stdout.splitlines():
        if line.startswith("[dry-run] launch :: "):
            plan["launch"].append({"cmd": line.split(" :: ", 1)[1]})
            continue
        match = re.match(r"\[dry-run\] (node=\S+ role=\S+.*?) :: (.*)$", line)
        if match:
            fields = dict(item.split("=", 1) for item in match.group(1).split())
            fields["cmd"] = match.group(2)
            plan[fields["role"]].append(fields)
    return plan


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_bash_syntax(path: Path) -> None:
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_shellcheck_clean() -> None:
    require_executable("shellcheck", "shellcheck")
    result = subprocess.run(["shellcheck", "-x", *map(str, SHELL_FILES)], capture_output=True, text=True,
                            cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", [*GPU_SCRIPTS, "grpo_tiny_cpu.sh"])
def test_sbatch_header(script: str) -> None:
    text = (REPO / "slurm" / script).read_text()
    header = dict(re.findall(r"^#SBATCH --([a-z-]+)=(\S+)", text, flags=re.M))
    assert header["signal"] == "B:USR1@120"
    assert "time" in header and "job-name" in header
    defaults = dict(re.findall(r"(GRPO_DEFAULT_\w+)=(\d+)", text))
    assert int(header["nodes"]) == int(defaults["GRPO_DEFAULT_NODES"])
    assert int(header.get("gpus-per-node", 0)) == int(defaults["GRPO_DEFAULT_GPUS_PER_NODE"])
    if script in GPU_SCRIPTS:
        recipe, nodes = GPU_SCRIPTS[script]
        assert int(header["nodes"]) == nodes
        assert header["ntasks-per-node"] == header["gpus-per-node"] == "8"  # one task per GPU
        assert f"RECIPE:={recipe}" in text
    assert 'grpo_main "$@"' in text  # recipe overrides from the command line


@pytest.mark.parametrize("script", list(GPU_SCRIPTS))
def test_gpu_recipe_validates_for_its_layout(script: str) -> None:
    from megatron_grpo.config import load_config, validate

    recipe, _ = GPU_SCRIPTS[script]
    plan = parse_plan(dry_run(script).stdout)
    world = sum(int(t["tasks"]) for t in plan["trainer"])
    config = load_config(REPO / "recipes" / f"{recipe}.yaml")
    validate(config, world_size=world)
    assert config.rollout.engine == "sglang" and config.model.dtype == "bfloat16"


def test_dry_run_qwen3_8b_colocated() -> None:
    result = dry_run("grpo_qwen3_8b.sh", "actor.optim.lr=2e-6", "model.fp32_lm_head=true")
    assert result.returncode == 0, result.stderr
    # this venv has no SGLang: the plan is printed, with the warning the real run would stop on
    assert f"WARNING: {sys.executable} lacks sglang, which starts the SGLang engines" in result.stderr, result.stderr
    assert "WARNING: server port" not in result.stderr  # 30000-30080 lie below the ephemeral range
    plan = parse_plan(result.stdout)
    [trainer] = plan["trainer"]
    assert (trainer["node"], trainer["ranks"], trainer["tasks"]) == ("node1", "0-7", "8")
    assert trainer["gpus"] == "0,1,2,3,4,5,6,7" and trainer["gpu_of_task"] == "local_rank"
    engines = plan["engine"]
    assert len(engines) == 8 and all(e["node"] == "node1" for e in engines)  # colocated
    assert [e["gpus"] for e in engines] == [str(i) for i in range(8)]  # one GPU each, no overlap
    assert [e["url"] for e in engines] == [f"http://node1:{30000 + 10 * i}" for i in range(8)]
    for i, engine in enumerate(engines):
        assert f"--tp-size 1 --base-gpu-id {i} " in engine["cmd"]
        assert "--enable-memory-saver" in engine["cmd"] and "--mem-fraction-static 0.4" in engine["cmd"]
        # the cluster recipes are throughput-first: no deterministic inference (the 70B run below asks for it)
        assert "--enable-deterministic-inference" not in engine["cmd"]
        assert "--enable-fp32-lm-head" in engine["cmd"]  # model.fp32_lm_head: both sides
        # the key comes from the job's environment, never on the command line
        assert "-m megatron_grpo.launch.api_key_exec GRPO_SGLANG_API_KEY sglang.launch_server " in engine["cmd"]
        assert "--api-key" not in engine["cmd"]
    assert plan["router"] == []
    # the doctor runs first, once per node, with the job's layout and the engines' ports
    lines = result.stdout.splitlines()
    doctor = next(i for i, line in enumerate(lines) if line.startswith("[dry-run] doctor :: "))
    assert doctor < min(i for i, line in enumerate(lines) if line.startswith("[dry-run] launch :: "))
    assert "srun --nodes=1 --ntasks-per-node=1 --ntasks=1 --job-name=doctor" in lines[doctor]
    assert "-m megatron_grpo.cli doctor qwen3_8b_gsm8k " in lines[doctor]
    assert "--world-size 8 --ranks-per-node 8 " in lines[doctor]
    assert "".join(f"--port {30000 + 10 * i} " for i in range(8)) + "--starts-engines" in lines[doctor]
    assert re.search(r"^\[dry-run\] env GRPO_SGLANG_API_KEY=<64 random hex digits", result.stdout, re.M)
    trainer_launch = plan["launch"][-1]["cmd"]
    assert "srun --nodes=1 --ntasks-per-node=8 --ntasks=8" in trainer_launch
    assert "--overlap" in trainer_launch and "--kill-on-bad-exit=1" in trainer_launch
    assert "--gpus-per-task" not in trainer_launch  # every task sees all GPUs (CUDA IPC, P2P)
    assert sum("--overlap --nodes=1 --ntasks=1 --nodelist=node1" in launch["cmd"] for launch in plan["launch"]) == 8
    cmd = trainer["cmd"]
    assert "-m megatron_grpo.train qwen3_8b_gsm8k" in cmd
    assert "rollout.sglang.api_key_env=GRPO_SGLANG_API_KEY" in cmd
    for i in range(8):
        assert f"http://node1:{30000 + 10 * i}" in cmd
    assert cmd.endswith("actor.optim.lr=2e-6 model.fp32_lm_head=true")  # the user's override comes last and wins
    assert "NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0" in result.stdout


def test_a_python_without_the_environment_is_named_before_anything_starts(tmp_path) -> None:
    """The submitting shell without the venv active: the system python (which can still `import
    megatron_grpo` from the repository folder) lacks torch and megatron-core."""
    system_python = shutil.which("python3", path="/usr/bin")
    assert system_python, "the machines have /usr/bin/python3"
    result = dry_run("grpo_qwen3_8b.sh", GRPO_PYTHON=system_python)
    assert result.returncode == 1 and not result.stdout.count("[dry-run]"), result.stdout
    assert re.search(rf"ERROR: {re.escape(system_python)} lacks torch megatron\.core( yaml)?: activate the "
                     r"environment where megatron-grpo is installed \(bash scripts/setup_env\.sh\) or set GRPO_PYTHON",
                     result.stderr), result.stderr


def test_dry_run_llama3_70b_dedicated() -> None:
    """Also SGLANG_PORT inside the ephemeral port range: the plan uses it, with a warning."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    result = dry_run("grpo_llama3_70b.sh", "rollout.sglang.deterministic_inference=true", HF_MODEL="/models/llama3-70b",
                     SGLANG_PORT=str(low + 1))
    assert result.returncode == 0, result.stderr
    assert f"WARNING: server port {low + 1} (SGLANG_PORT" in result.stderr
    assert f"lies in the ephemeral port range {low}-{high}" in result.stderr, result.stderr
    plan = parse_plan(result.stdout)
    trainers = plan["trainer"]
    assert [t["node"] for t in trainers] == ["node1", "node2", "node3", "node4"]
    assert [t["ranks"] for t in trainers] == ["0-7", "8-15", "16-23", "24-31"]
    assert all(t["tasks"] == "8" and t["gpus"] == "0,1,2,3,4,5,6,7" for t in trainers)
    engines = plan["engine"]
    assert [e["node"] for e in engines] == ["node5", "node5", "node6", "node6", "node7", "node7",
                                            "node8", "node8"]  # dedicated: none on trainer nodes
    assert [e["gpus"] for e in engines] == ["0,1,2,3", "4,5,6,7"] * 4
    assert [e["url"].rsplit(":", 1)[1] for e in engines] == [str(low + 1), str(low + 11)] * 4
    for engine in engines:
        assert "--model-path /models/llama3-70b --tp-size 4" in engine["cmd"]
        assert "--enable-deterministic-inference" in engine["cmd"]  # asked for: the trainer's seeds take effect
        assert "--enable-memory-saver" not in engine["cmd"] and "--enable-fp32-lm-head" not in engine["cmd"]
        assert f"--host {engine['node']} " in engine["cmd"]
    [router] = plan["router"]
    assert router["node"] == "node1" and "--policy cache_aware" in router["cmd"]
    assert router["cmd"].endswith(" ".join(e["url"] for e in engines))
    trainer_launch = plan["launch"][-1]["cmd"]
    assert "srun --nodes=4 --ntasks-per-node=8 --ntasks=32" in trainer_launch
    assert r"--nodelist=node1\,node2\,node3\,node4" in trainer_launch
    assert "--overlap" not in trainer_launch
    assert "model.path=/models/llama3-70b" in trainers[0]["cmd"]


def test_dry_run_qwen3_30b_a3b_expert_parallel() -> None:
    """The MoE recipe: 16 trainer ranks on nodes 1-2 (TP 2 x DP 8; EP 8 groups of 8 consecutive
    ranks, one node each), 8 engines of tp_size 2 on nodes 3-4 behind the router."""
    from megatron_grpo.config import load_config, validate

    result = dry_run("grpo_qwen3_30b_a3b.sh", HF_MODEL="/models/qwen3-30b-a3b")
    assert result.returncode == 0, result.stderr
    plan = parse_plan(result.stdout)
    trainers = plan["trainer"]
    assert [(t["node"], t["ranks"], t["tasks"]) for t in trainers] == [("node1", "0-7", "8"), ("node2", "8-15", "8")]
    engines = plan["engine"]
    assert [e["node"] for e in engines] == ["node3"] * 4 + ["node4"] * 4
    assert [e["gpus"] for e in engines] == ["0,1", "2,3", "4,5", "6,7"] * 2
    assert all("--model-path /models/qwen3-30b-a3b --tp-size 2" in e["cmd"] for e in engines)
    [router] = plan["router"]
    assert router["node"] == "node1" and router["cmd"].endswith(" ".join(e["url"] for e in engines))
    assert "model.path=/models/qwen3-30b-a3b" in trainers[0]["cmd"]
    config = load_config(REPO / "recipes" / "qwen3_30b_a3b_gsm8k.yaml")
    validate(config, world_size=16)
    p = config.parallel
    assert (p.tensor, p.expert, p.expert_tensor, p.sequence_parallel) == (2, 8, 1, True)
    assert 16 // (p.expert * p.expert_tensor) == 2  # expert-data-parallel ranks: the Adam states' shards
    result = dry_run("grpo_qwen3_30b_a3b.sh", "parallel.expert=3")
    assert result.returncode != 0 and "parallel.expert x expert_tensor x pipeline = 3 x 1 x 1" in result.stderr


def test_dry_run_glm45_air_expert_and_pipeline_parallel() -> None:
    """GLM-4.5-Air: 32 trainer ranks on nodes 1-4 (TP 4 x PP 2 x DP 4; per stage EP 16 over two
    nodes, expert-DP 1), 2 engines of tp_size 8 on nodes 5-6 behind the router."""
    from megatron_grpo.config import load_config, validate

    result = dry_run("grpo_glm45_air.sh", HF_MODEL="/models/glm-4.5-air")
    assert result.returncode == 0, result.stderr
    plan = parse_plan(result.stdout)
    assert [(t["node"], t["ranks"]) for t in plan["trainer"]] == [
        ("node1", "0-7"), ("node2", "8-15"), ("node3", "16-23"), ("node4", "24-31")]
    engines = plan["engine"]
    assert [(e["node"], e["gpus"]) for e in engines] == [("node5", "0,1,2,3,4,5,6,7"), ("node6", "0,1,2,3,4,5,6,7")]
    assert all("--model-path /models/glm-4.5-air --tp-size 8" in e["cmd"] for e in engines)
    [router] = plan["router"]
    assert router["node"] == "node1" and router["cmd"].endswith(" ".join(e["url"] for e in engines))
    config = load_config(REPO / "recipes" / "glm45_air_gsm8k.yaml")
    validate(config, world_size=32, ranks_per_node=8)
    p = config.parallel
    assert (p.tensor, p.pipeline, p.expert, p.expert_tensor, p.sequence_parallel) == (4, 2, 16, 1, True)
    assert 32 // (p.pipeline * p.expert * p.expert_tensor) == 1  # expert-data-parallel ranks
    # the hub id has no local config.json, so validate() cannot see the model's dims: checked here against
    # the published config the planner builds (46 layers: PP 4 would not divide them)
    hub = json.loads((REPO / "megatron_grpo/plan/hub_configs.json").read_text())["zai-org/GLM-4.5-Air"]["config"]
    assert hub["num_hidden_layers"] % p.pipeline == 0 and hub["num_hidden_layers"] % 4
    assert hub["num_attention_heads"] % p.tensor == hub["num_key_value_heads"] % p.tensor == 0
    assert hub["n_routed_experts"] % p.expert == 0
    assert hub["num_key_value_heads"] % config.rollout.sglang.tp_size == 0  # SGLang's tp 8: one KV head per GPU


def test_dry_run_explains_impossible_layouts() -> None:
    result = dry_run("grpo_llama3_70b.sh", GPUS_PER_NODE="2")
    assert result.returncode != 0 and "tp_size=4 does not divide the 2 GPUs" in result.stderr
    result = dry_run("grpo_qwen3_8b.sh", "rollout.sglang.num_engines=9")
    assert result.returncode != 0 and "need 9 GPUs, the job has 8" in result.stderr
    result = dry_run("grpo_qwen3_8b.sh", "parallel.tensor=3")
    assert result.returncode != 0 and "not divisible by parallel.tensor x pipeline x context = 3" in result.stderr
    result = dry_run("grpo_qwen3_8b.sh", "actor.ppo_mini_batch_size=1", "data.train_batch_size=1", "rollout.n=3")
    assert result.returncode != 0 and "not divisible by the data-parallel size 4" in result.stderr
    result = dry_run("grpo_tiny_cpu.sh", ENGINE_PLACEMENT="dedicated")
    assert result.returncode != 0 and "need GPUs" in result.stderr


def test_dry_run_qwen3_8b_with_its_reward_model_servers() -> None:
    """recipes/qwen3_8b_gsm8k_rm.yaml through the 8B script: the parent's engines and trainer, plus
    one reward-model server per GPU of reward.models.rm.sglang.gpus (6, 7) on the batch node, with the
    job's key from the environment; the trainer gets their URLs (and launches none)."""
    import shlex

    from megatron_grpo.config import load_config, validate

    model = "/shared/models/Skywork-Reward-V2-Llama-3.1-8B"
    result = dry_run("grpo_qwen3_8b.sh", f"reward.models.rm.path={model}", RECIPE="qwen3_8b_gsm8k_rm")
    assert result.returncode == 0, result.stderr
    plan = parse_plan(result.stdout)
    assert len(plan["engine"]) == 8 and [e["gpus"] for e in plan["engine"]] == [str(i) for i in range(8)]
    servers = plan["reward_model"]
    assert [(s["node"], s["name"], s["gpus"], s["url"]) for s in servers] == [
        ("node1", "rm", "6", "http://node1:31000"), ("node1", "rm", "7", "http://node1:31001")]
    for i, server in enumerate(servers):
        assert (f"-m megatron_grpo.launch.api_key_exec GRPO_SGLANG_API_KEY sglang.launch_server --model-path {model} "
                f"--tp-size 1 --base-gpu-id {6 + i} --host node1 --port {31000 + i} --mem-fraction-static 0.14 "
                "--is-embedding --random-seed 0") in server["cmd"]
        assert "--api-key" not in server["cmd"] and "--enable-memory-saver" not in server["cmd"]  # resident
    assert re.search(r"^\[dry-run\] env GRPO_SGLANG_API_KEY=<64 random hex digits", result.stdout, re.M)
    [trainer] = plan["trainer"]
    args = shlex.split(trainer["cmd"])
    given = ['reward.models.rm.sglang.urls=["http://node1:31000","http://node1:31001"]',
             "reward.models.rm.sglang.gpus=[]", "reward.models.rm.sglang.api_key_env=GRPO_SGLANG_API_KEY"]
    assert all(arg in args for arg in given), args
    cfg = load_config("qwen3_8b_gsm8k_rm", [a for a in args if a.startswith(("reward.", "rollout."))])
    validate(cfg, world_size=8, ranks_per_node=8)
    assert cfg.reward.models["rm"].sglang.urls == ["http://node1:31000", "http://node1:31001"]
    assert cfg.reward.models["rm"].path == model
