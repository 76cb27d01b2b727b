"""Lazy imports of optional dependencies, each failing with one line that names its pip extra."""
from __future__ import annotations

import importlib
from types import ModuleType

from megatron_grpo.errors import MissingExtraError

# module -> the extra (pyproject.toml) that installs it
EXTRAS = {
    "transformer_engine": "gpu",
    "sglang": "sglang",
    "sglang_router": "sglang",
    "mpi4py": "mpi",
    "torch.utils.tensorboard": "logging",
    "wandb": "logging",
    "matplotlib": "plot",
}


def require(module: str, purpose: str) -> ModuleType:
    """Imports `module` or raises MissingExtraError naming the extra, e.g. for 'wandb':
    "wandb is needed for logging.wandb=true: pip install 'megatron-grpo[logging]'"."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = EXTRAS.get(module)
        hint = f"pip install 'megatron-grpo[{extra}]'" if extra else f"pip install {module}"
        raise MissingExtraError(f"{module} is needed for {purpose}: {hint} ({exc})") from None


def available(module: str) -> bool:
    """True if `module` imports; never raises."""
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False
