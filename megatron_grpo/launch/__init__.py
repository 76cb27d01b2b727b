"""Launch layer: rank discovery, process groups, megatron parallel_state, seeds, CPU compat.

    from megatron_grpo.launch import init_distributed, initialize_model_parallel, ParallelLayout, shutdown
    ctx = init_distributed()                                   # torchrun / srun / mpirun / plain python
    initialize_model_parallel(ParallelLayout(tensor=2, pipeline=2), seed=1234)

Names are imported lazily so that `megatron_grpo.launch.env` stays free of torch (the CLI reads
configs before anything heavy is imported).
"""
import importlib

_EXPORTS = {
    "DistributedContext": "distributed", "init_distributed": "distributed", "shutdown": "distributed",
    "RankInfo": "env", "discover_ranks": "env",
    "ParallelLayout": "parallel", "initialize_model_parallel": "parallel", "set_seed": "parallel",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
