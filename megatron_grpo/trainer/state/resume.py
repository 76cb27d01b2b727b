"""Where a run starts: the checkpoint its resume plan restores (trainer/state/checkpoint.py), or step 0;
then the rollout engine is given the weights the run continues from, and metrics.jsonl loses the
records a crashed earlier life logged after that step."""
from __future__ import annotations

import logging
import time
from pathlib import Path

from megatron_grpo.trainer.state.checkpoint import Checkpointer
from megatron_grpo.trainer.metrics import METRICS_FILE, trim_metrics
from megatron_grpo.trainer.sync.weight_sync import ensure_engine_holds_the_start, sync_weights

log = logging.getLogger(__name__)


def resume(run, checkpointer: Checkpointer) -> int:
    """Collective. Returns the step the run continues after (0: a fresh start)."""
    began = time.monotonic()
    restored = checkpointer.restore()
    loaded = time.monotonic()
    if restored is None:
        ensure_engine_holds_the_start(run)
        step = 0
    else:
        sync_weights(run, version=restored.engine_weight_version)
        step = restored.step
    # the restore / weight-push split of a restart's recovery time (docs/checkpoints.md)
    log.info("start: step %d restored in %.2f s, engine weights pushed in %.2f s", step, loaded - began,
             time.monotonic() - loaded)
    keeps_folder = restored is not None or run.config.checkpoint.resume.strip() in ("auto", "force")
    if run.is_main and keeps_folder:  # resume=never moved an earlier run aside (run_folder.py)
        trim_metrics(Path(run.config.logging.output_dir) / METRICS_FILE, step)
    return step
