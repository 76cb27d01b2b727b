"""Where a recipe's processes go on a cluster: the trainer's GPUs and the engines', as the sbatch
scripts place them (slurm/lib/grpo_common.sh grpo_plan), and the model's config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from megatron_grpo.config.schema import Config
from megatron_grpo.errors import ConfigError


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_memory_gb: float  # GiB, as nvidia-smi shows it (H100: 80, H200: 141)
    link_gbps: float = 400.0  # one GPU's network link (InfiniBand NDR), for the weight-sync estimate
    # CUDA context, NCCL buffers and allocator fragmentation: memory no tensor of the step holds
    reserve_gb: float = 3.0

    def __post_init__(self) -> None:
        if self.reserve_gb < 0:
            raise ConfigError(f"--reserve-gb={self.reserve_gb}: expected a number >= 0")
        for name in ("nodes", "gpus_per_node", "gpu_memory_gb", "link_gbps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')}={getattr(self, name)}: expected a number > 0")

    @property
    def gpu_memory_bytes(self) -> int:
        return int(self.gpu_memory_gb * 2**30)

    @property
    def trainer_budget_bytes(self) -> int:
        """What the step's tensors may peak at on one GPU."""
        return int((self.gpu_memory_gb - self.reserve_gb) * 2**30)


@dataclass(frozen=True)
class Placement:
    kind: str  # "dedicated" (engines on their own nodes), "colocated" (on the trainer's GPUs), "none"
    trainer_gpus: int
    engine_nodes: int


def placement(cfg: Config, cluster: Cluster) -> Placement:
    """The sbatch scripts' automatic placement: SGLang with weight_sync=tensor shares the trainer's
    GPUs; other SGLang runs get ceil(engines x tp / GPUs per node) nodes of their own."""
    s = cfg.rollout.sglang
    if cfg.rollout.engine != "sglang" or s.urls:
        return Placement("none", cluster.nodes * cluster.gpus_per_node, 0)
    need = -(-s.num_engines * s.tp_size // cluster.gpus_per_node)
    if s.weight_sync == "tensor":
        if s.num_engines * s.tp_size > cluster.nodes * cluster.gpus_per_node:
            raise ConfigError(f"colocated engines: {s.num_engines} x tp {s.tp_size} need more than the "
                              f"{cluster.nodes * cluster.gpus_per_node} GPUs of --nodes {cluster.nodes}")
        return Placement("colocated", cluster.nodes * cluster.gpus_per_node, need)
    if need >= cluster.nodes:
        raise ConfigError(f"dedicated engines: {s.num_engines} engines x tp {s.tp_size} need {need} of the "
                          f"{cluster.nodes} nodes, leaving none for the trainer (give more --nodes)")
    return Placement("dedicated", (cluster.nodes - need) * cluster.gpus_per_node, need)


HUB_CONFIGS = "hub_configs.json"


def model_config_dict(cfg: Config) -> tuple[dict[str, Any], str]:
    """The HF config.json fields of model.path (a local folder or file, else a model this package
    ships the config of; without a path, the from-scratch model's), with model.override_config on
    top, and where they came from."""
    from megatron_grpo.config.model_dims import hf_config_file

    file = hf_config_file(cfg.model)
    if cfg.model.path is None:  # a model built from scratch (trainer/assembly/initial_model.py)
        from megatron_grpo.trainer.assembly.initial_model import initial_config_source, initial_hf_config

        return initial_hf_config(cfg).to_dict(), initial_config_source(cfg)
    if file is not None:
        try:
            fields = json.loads(Path(file).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the model config {file}: {exc}") from None
        source = str(file)
    else:
        known = json.loads(resources.files("megatron_grpo.plan").joinpath(HUB_CONFIGS).read_text(encoding="utf-8"))
        entry = known.get(str(cfg.model.path))
        if entry is None:
            names = ", ".join(k for k in known if not k.startswith("_"))
            raise ConfigError(f"model.path={cfg.model.path}: no local config.json, and not a model whose config "
                              f"ships with megatron-grpo ({names}); give model.config_path=/path/to/config.json")
        fields, source = dict(entry["config"]), entry["source"]
    return {**fields, **cfg.model.override_config}, source
