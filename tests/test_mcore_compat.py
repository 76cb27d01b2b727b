"""launch/mcore_compat.py: the version-specific megatron-core calls and the known console notices,
on whichever megatron-core this lane installed (CI: 0.16.1 on Python 3.11, 0.19.2 on 3.12)."""
import logging
import warnings

import pytest

from megatron_grpo.launch import mcore_compat

# The notices as megatron-core 0.16.1 / 0.19.2 and torch 2.14.1 print them (copied from their sources).
LOGGED = {
    "megatron.core.models.gpt.gpt_model":
        "GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes, no new features. Please reference "
        "the migration guide `docs/user-guide/hybrid-model-migration.md` for details on how to use `HybridModel`",
    "megatron.core.distributed.distributed_data_parallel":
        "DistributedDataParallel: full_param_layout not provided with use_distributed_optimizer=True. "
        "Auto-computing layout inside DDP. Callers should pre-compute layouts via "
        "DistributedOptimizer.compute_full_param_layout() and pass them in.",
    "megatron.core.dist_checkpointing.strategies.torch":
        "MCore's async save is deprecated and will be removed in the future releases. Please, use NVRx async "
        "solution by setting `async_strategy` to `nvrx`.",
    "torch.utils.cpp_extension": "No CUDA runtime is found, using CUDA_HOME='/usr/local'",
}
WARNED = [
    "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
    "absl.logging is not installed. Using logging.getLogger(__name__) instead. Please install absl.logging "
    "with `pip install absl-py` to use absl.logging.",
    "MimoModelConfig is experimental and still under active development. The API may change without notice "
    "in future releases.",
]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def quieted():
    saved_filters = warnings.filters[:]
    loggers = {name: logging.getLogger(name) for name in LOGGED}
    saved = {name: (logger.filters[:], logger.handlers[:], logger.propagate, logger.level)
             for name, logger in loggers.items()}
    for logger in loggers.values():
        # what this test sees must not depend on the tests before it in this process (an in-process
        # `megatron-grpo plan` sets the "megatron" logger to ERROR, which these loggers inherit)
        logger.setLevel(logging.WARNING)
    mcore_compat.quiet_known_notices()
    mcore_compat.quiet_known_notices()  # idempotent: one filter per logger
    yield loggers
    warnings.filters[:] = saved_filters
    for name, (filters, handlers, propagate, level) in saved.items():
        loggers[name].filters[:], loggers[name].handlers[:], loggers[name].propagate = filters, handlers, propagate
        loggers[name].setLevel(level)


def test_known_notices_are_dropped_and_nothing_else(quieted):
    for name, logger in quieted.items():
        assert sum(isinstance(f, mcore_compat._DropNotices) for f in logger.filters) == 1, name
        records = _Records()
        logger.addHandler(records)
        logger.propagate = False
        logger.warning(LOGGED[name])
        logger.warning("a checkpoint shard is missing")  # anything else from the same logger stays
        assert records.messages == ["a checkpoint shard is missing"], name
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcore_compat.quiet_known_notices()  # on top of "always": the known ones are ignored again
        for message in WARNED:
            warnings.warn(message, UserWarning, stacklevel=1)
        warnings.warn("Transformer Engine is missing a kernel", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["Transformer Engine is missing a kernel"]


def test_checkpoint_results_queue_factory_is_this_versions():
    module, name = mcore_compat.checkpoint_results_queue_factory()
    assert module.__name__ == "megatron.core.dist_checkpointing.strategies.filesystem_async"
    expected = "get_write_results_queue" if mcore_compat.megatron_core_version() >= (0, 19, 0) else \
        "_get_write_results_queue"
    assert name == expected and callable(getattr(module, name))

