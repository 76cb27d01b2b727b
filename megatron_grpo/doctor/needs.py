"""The recipe's needs, checked against this node: one Finding per row of the doctor's table."""
from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_grpo.config import validate
from megatron_grpo.config.model_paths import local_path_reason
from megatron_grpo.config.schema import Config
from megatron_grpo.doctor import node
from megatron_grpo.doctor.report import Finding
from megatron_grpo.doctor.tested import canonical, pinned_versions
from megatron_grpo.errors import ConfigError

# A megatron checkpoint holds, per parameter, the bf16 weight and the distributed optimizer's fp32
# main weight, Adam's exp_avg and exp_avg_sq: 2 + 3 x 4 bytes.
CHECKPOINT_BYTES_PER_PARAM = 14
HF_EXPORT_BYTES_PER_PARAM = 2  # checkpoint.save_hf: the policy in bf16
GIB = 2**30


@dataclass(frozen=True)
class Placement:
    """Where the recipe runs: what the sbatch scripts know and the recipe does not."""

    world_size: Optional[int] = None  # trainer ranks of the whole job; None = not checked
    ranks_per_node: Optional[int] = None  # trainer ranks (GPUs) on this node
    ports: Optional[tuple[int, ...]] = None  # server ports that must be free here; None = the recipe's
    bind_host: Optional[str] = None  # address those servers bind; None = rollout.sglang.host
    starts_engines: bool = False  # the job starts SGLang servers on its nodes (slurm/), whatever the urls say

    @property
    def spans_nodes(self) -> bool:
        """More trainer ranks than this node holds: the collectives cross the network."""
        return (self.world_size or 0) > (self.ranks_per_node or self.world_size or 0)


def check_recipe(config: Config, placement: Placement) -> list[Finding]:
    findings: list[Finding] = []
    for check in (_python, _torch_and_gpus, _packages, _paths, _output, _ports, _network, _layout, _api_key):
        findings += check(config, placement)
    return findings


def launches_engines(config: Config, placement: Placement) -> bool:
    """True when SGLang servers start on this node for this run (by the trainer, or by slurm/, which
    hands the trainer their URLs), so the node needs SGLang."""
    return config.rollout.engine == "sglang" and (placement.starts_engines or not config.rollout.sglang.urls)


def _versus_tested(check: str, pkg: node.Package, dist: str, needed: bool, why: str) -> Finding:
    tested = pinned_versions().get(canonical(dist))
    needs = f"{why}; tested {tested}" if tested else why
    if not pkg.imports:
        has = pkg.error if pkg.version is None else f"{pkg.version}, does not import ({pkg.error})"
        return Finding.blocker(check, needs, has) if needed else Finding.note(check, needs, has)
    if tested and pkg.version and pkg.version.split("+")[0] != tested:
        return Finding.note(check, needs, f"{pkg.version} (not the tested version)")
    return Finding.ok(check, needs, pkg.version or "installed")


def _python(config: Config, placement: Placement) -> list[Finding]:
    have = platform.python_version()
    if sys.version_info < (3, 10):
        return [Finding.blocker("python", ">= 3.10; tested 3.12", have)]
    status = Finding.ok if sys.version_info[:2] == (3, 12) else Finding.note
    return [status("python", ">= 3.10; tested 3.12", have)]


def _needs_cuda(config: Config) -> bool:
    """SGLang picks its own device (it has a CPU backend): only the trainer's device decides."""
    return config.trainer.device == "cuda"


def _torch_and_gpus(config: Config, placement: Placement) -> list[Finding]:
    view = node.torch_view()
    torch_row = _versus_tested("torch", node.Package("torch", view.version, view.error), "torch", True, "the trainer")
    if view.version is None:
        return [torch_row]
    build = f"CUDA {view.cuda_build} build" if view.cuda_build else "CPU build"
    ranks = placement.ranks_per_node or 1
    if not _needs_cuda(config):
        needs = "none (trainer.device=cpu)" if config.trainer.device == "cpu" else "optional (trainer.device=auto)"
        has = f"{build}, {len(view.gpus)} visible" if view.cuda_available else f"{build}, none usable"
        return [torch_row, Finding.ok("GPUs", needs, has)]
    needs = f"CUDA, {ranks} GPU(s) on this node (trainer.device=cuda)"
    if not view.cuda_available:
        why = "a CPU build of torch" if not view.cuda_build else "no GPU visible (CUDA_VISIBLE_DEVICES, the driver)"
        return [torch_row, Finding.blocker("GPUs", needs, f"none: {why}")]
    names = sorted({f"{g.name} ({g.memory_gib:.0f} GiB)" for g in view.gpus})
    has = f"{len(view.gpus)} x {', '.join(names)}; {build}"
    rows = [torch_row, (Finding.ok if len(view.gpus) >= ranks else Finding.blocker)("GPUs", needs, has)]
    rows.append((Finding.ok if view.nccl else Finding.blocker)("NCCL", "for the trainer's collectives",
                                                            view.nccl or "absent from this torch build"))
    return rows


def _packages(config: Config, placement: Placement) -> list[Finding]:
    sglang_here = launches_engines(config, placement)
    router_here = sglang_here and config.rollout.sglang.router
    mpi_needed = _under_mpi_without_master()
    rows = [
        _versus_tested("megatron-core", node.package("megatron.core", "megatron-core", "megatron_core"),
                       "megatron-core", True, "the policy"),
        _versus_tested("transformers", node.package("transformers"), "transformers", True, "tokenizers, HF configs"),
        _versus_tested("transformer-engine", node.package("transformer_engine.pytorch", "transformer-engine",
                                                          "transformer_engine_torch", "transformer_engine"),
                       "transformer-engine", False, "optional: used when it imports, else the local spec (slower)"),
        _versus_tested("apex", node.package("apex"), "apex", False, "optional, not used by default"),
        _versus_tested("sglang", node.package("sglang"), "sglang", sglang_here,
                       "the rollout engines started here" if sglang_here else f"not needed ({_engine_why(config)})"),
        _versus_tested("sglang-router", node.package("sglang_router", "sglang-router"), "sglang-router", router_here,
                       "rollout.sglang.router=true" if router_here else "not needed (no router)"),
        _versus_tested("mpi4py", node.package("mpi4py"), "mpi4py", mpi_needed,
                       "mpirun without MASTER_ADDR" if mpi_needed else "only under mpirun without MASTER_ADDR"),
    ]
    return rows


def _engine_why(config: Config) -> str:
    return "rollout.engine=local" if config.rollout.engine == "local" else "engines given by rollout.sglang.urls"


def _under_mpi_without_master() -> bool:
    return "MASTER_ADDR" not in os.environ and any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"))


def _paths(config: Config, placement: Placement) -> list[Finding]:
    rows = []
    m = config.model
    for key, value in (("model.path", m.path), ("model.config_path", m.config_path),
                       ("model.tokenizer_path", m.tokenizer_path), ("ref.model_path", config.ref.model_path)):
        if value is None:
            if key == "model.path":
                rows.append(Finding.ok(key, "the initial policy", "none: built from trainer.seed at the start"))
            continue
        if os.path.lexists(value) or local_path_reason(value) is not None:  # the trainer's rule (config/model_paths.py)
            problem = node.unreadable(Path(value).expanduser())
            rows.append(Finding.blocker(key, "readable", f"{value}: {problem}") if problem
                        else Finding.ok(key, "readable", value))
        else:  # the start resolves it (HF cache, else the hub) and says so in one line if it cannot
            rows.append(Finding.note(key, "a local folder (compute nodes often have no internet)",
                                     f"{value}: not a local path, so a hub id (the HF cache, else a download)"))
    for key, files in (("data.train_files", config.data.train_files), ("data.val_files", config.data.val_files)):
        for file in files:
            problem = node.unreadable(Path(file))
            rows.append(Finding.blocker(key, "readable", f"{file}: {problem}") if problem
                        else Finding.ok(key, "readable", file))
    if config.data.task and not config.data.train_files:
        rows.append(Finding.ok("data.task", "prompts", f"{config.data.task} (synthetic, made at the start)"))
    return rows


def _output(config: Config, placement: Placement) -> list[Finding]:
    out_dir = Path(config.logging.output_dir)
    save_dir = Path(config.checkpoint.save_dir) if config.checkpoint.save_dir else out_dir / "checkpoints"
    rows = []
    probe = node.writable_folder(out_dir)
    rows.append(Finding.blocker("logging.output_dir", "writable", f"{out_dir}: {probe.error} (at {probe.existing})")
                if probe.error else Finding.ok("logging.output_dir", "writable", str(out_dir)))
    ckpt = node.writable_folder(save_dir)
    params = _parameter_count(config)
    per_save = None if params is None else params * (
        CHECKPOINT_BYTES_PER_PARAM + (HF_EXPORT_BYTES_PER_PARAM if config.checkpoint.save_hf else 0))
    keep = config.checkpoint.keep_last
    free = "unknown" if ckpt.free_bytes is None else f"{ckpt.free_bytes / GIB:.1f} GiB free at {ckpt.existing}"
    if per_save is None:
        needs = "writable (size unknown: no model folder to measure)"
    else:
        peak = "every save kept" if keep is None else f"{keep + 1} at peak with keep_last={keep}"
        needs = f"writable, {per_save / GIB:.1f} GiB a checkpoint ({params / 1e9:.2f}B params; {peak})"
    if ckpt.error:
        rows.append(Finding.blocker("checkpoint.save_dir", needs, f"{save_dir}: {ckpt.error}"))
    elif per_save is not None and ckpt.free_bytes < per_save:
        rows.append(Finding.blocker("checkpoint.save_dir", needs, free))
    elif per_save is not None and keep is not None and ckpt.free_bytes < per_save * (keep + 1):
        rows.append(Finding.note("checkpoint.save_dir", needs, free))
    else:
        rows.append(Finding.ok("checkpoint.save_dir", needs, free))
    return rows


def _parameter_count(config: Config) -> Optional[int]:
    """Parameters of the model folder's weights, from their size on disk and config.json's dtype."""
    folder = Path(config.model.path) if config.model.path else None
    try:
        if folder is None or not folder.is_dir():
            return None
        weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        fields = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # the model.path row reports the folder's problem
        return None
    if not weights or not isinstance(fields, dict):
        return None
    dtype = fields.get("dtype") or fields.get("torch_dtype") or "bfloat16"  # transformers 5 writes "dtype"
    return weights // (4 if dtype == "float32" else 2)


def _ports(config: Config, placement: Placement) -> list[Finding]:
    s = config.rollout.sglang
    ports = placement.ports
    if ports is None:  # the trainer starts the servers on rank 0's node
        if not launches_engines(config, placement):
            return []
        ports = tuple(s.port + i for i in range(s.num_engines)) + ((s.router_port,) if s.router else ())
    host = placement.bind_host or s.host
    taken = {port: problem for port in ports if (problem := node.port_taken(host, port))}
    needs = f"{_port_list(ports)} free on {host} (servers bind them)"
    if taken:
        return [Finding.blocker("ports", needs, "; ".join(f"{port}: {why}" for port, why in taken.items()))]
    return [Finding.ok("ports", needs, "free")]


def _port_list(ports: tuple[int, ...]) -> str:
    """30000-30007, 30080: consecutive ports as a range."""
    runs: list[list[int]] = []
    for port in ports:
        if runs and port == runs[-1][-1] + 1:
            runs[-1].append(port)
        else:
            runs.append([port])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _network(config: Config, placement: Placement) -> list[Finding]:
    rows = []
    present = node.interfaces()
    for variable in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        value = os.environ.get(variable)
        if not value:
            if placement.spans_nodes:
                rows.append(Finding.note(variable, "the interface between nodes", "unset: the library picks one"))
            continue
        # NCCL takes prefixes with ^ (exclude) and = (exact); Gloo only exact names, comma-separated
        matched = (_matching_interfaces(value, present) if variable.startswith("NCCL") else
                   [present[name] for name in value.split(",") if name in present])
        usable = [i for i in matched if i.up and i.ipv4]
        has = ", ".join(f"{i.name} {'/'.join(i.ipv4) or 'no IPv4'}{'' if i.up else ' (down)'}" for i in matched)
        if not usable:
            rows.append(Finding.blocker(variable, f"{value}: an interface that is up with an address",
                                        has or f"no such interface (this node has {', '.join(sorted(present))})"))
        elif placement.spans_nodes and all(i.name == "lo" for i in usable):  # right only when every "node" is this host
            rows.append(Finding.note(variable, f"{value}: an interface that reaches the other nodes",
                                     f"{has}: loopback reaches no other host"))
        else:
            rows.append(Finding.ok(variable, f"{value}: an interface that is up", has))
    return rows


def _matching_interfaces(spec: str, present: dict[str, node.Interface]) -> list[node.Interface]:
    """NCCL's syntax: a comma list of name prefixes; `=` for exact names; `^` excludes."""
    exclude = spec.startswith("^")
    exact = spec.lstrip("^").startswith("=")
    names = [n for n in spec.lstrip("^").lstrip("=").split(",") if n]

    def matches(name: str) -> bool:
        return any(name == n if exact else name.startswith(n) for n in names)

    return [i for name, i in sorted(present.items()) if matches(name) != exclude and (not exclude or name != "lo")]


def _layout(config: Config, placement: Placement) -> list[Finding]:
    rows = []
    if placement.world_size is not None:
        needs = f"{placement.world_size} ranks, {placement.ranks_per_node or '?'} per node: batches and layout fit"
        try:
            validate(config, world_size=placement.world_size, ranks_per_node=placement.ranks_per_node)
        except ConfigError as exc:
            rows.append(Finding.blocker("layout", needs, str(exc)))
        else:
            rows.append(Finding.ok("layout", needs, "agree"))
    gpus = os.environ.get("SLURM_GPUS_ON_NODE")
    if gpus and _needs_cuda(config):
        visible = len(node.torch_view().gpus)
        rows.append(Finding.ok("Slurm GPUs", f"SLURM_GPUS_ON_NODE={gpus} visible", f"{visible} visible")
                    if str(visible) == gpus.split(":")[-1] else
                    Finding.blocker("Slurm GPUs", f"SLURM_GPUS_ON_NODE={gpus} visible", f"{visible} visible"))
    return rows


def _api_key(config: Config, placement: Placement) -> list[Finding]:
    if config.rollout.engine != "sglang":
        return []
    variable = config.rollout.sglang.api_key_env
    if variable is None and launches_engines(config, placement) and not placement.starts_engines:
        return [Finding.ok("engine API key", "a key, so only this run can call the engines",
                           "a per-run key, made when the trainer starts them")]
    if variable is None:
        return [Finding.note("engine API key", "a key, so only this run can call the engines",
                             "none: rollout.sglang.api_key_env is not set (the slurm/ scripts set one)")]
    return [Finding.ok("engine API key", f"${variable} set", "set") if os.environ.get(variable)
            else Finding.blocker("engine API key", f"${variable} set (rollout.sglang.api_key_env)", "unset")]
