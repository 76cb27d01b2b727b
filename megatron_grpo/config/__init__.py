"""Typed recipe config: schema (dataclasses), YAML recipes with `defaults:`, dotted overrides,
cross-field validation, YAML serialisation. Imports nothing heavy (no torch, no megatron)."""
from megatron_grpo.config.loader import config_from_dict, load_config, resolve_recipe, to_dict, to_yaml
from megatron_grpo.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    FilterGroupsConfig,
    KlCtrlConfig,
    LocalEngineConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PolicyLossConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    SGLangConfig,
    TrainerConfig,
)
from megatron_grpo.config.validate import validate

__all__ = [
    "ActorConfig", "AlgorithmConfig", "CheckpointConfig", "Config", "DataConfig", "EvalConfig",
    "FilterGroupsConfig", "KlCtrlConfig", "LocalEngineConfig", "LoggingConfig", "ModelConfig",
    "OptimConfig", "ParallelConfig", "PolicyLossConfig", "RefConfig", "RewardConfig", "RolloutConfig",
    "SGLangConfig", "TrainerConfig", "config_from_dict", "load_config", "resolve_recipe", "to_dict",
    "to_yaml", "validate",
]
