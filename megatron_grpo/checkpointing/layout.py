"""The files of a training checkpoint and the rank-local checks on them (no torch.distributed).

    <save_dir>/step_N/
      model_optim/          megatron dist_checkpointing (torch_dist): model chunks + optimizer
                            (the model part loads at any TP/PP/DP; the distributed optimizer's
                            state in the format launch/mcore_compat.py asks for, recorded in
                            trainer_state.json: 'fully_sharded_model_space' (each rank's own
                            slices, nothing gathered) and 'fully_reshardable' (before) load at
                            any layout, 'dp_reshardable' (before that) only at the same TP x PP)
      trainer_state.json    step, LR scheduler, sampler position, engine weight version, skip
                            counters, layout and optimizer format
      rng/tp{t}-pp{p}-cp{c}-dp{d}.pt   python / numpy / torch / megatron-tracker RNG states of that rank
      config.yaml           the resolved config of the run that wrote it
      run.json              what defines the run (trainer/state/run_folder.py)
      hf/                   with checkpoint.save_hf: the policy as an HF folder
      complete.json         written last: the step and the size of every file above
    <save_dir>/latest       "step_N", replaced atomically (write a temp file, os.replace)

A checkpoint is complete when complete.json parses, names its folder's step, and every file it
lists has the recorded size; anything else (a .tmp-step_N left by a crash, a cut-short file) is
never loaded.
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from megatron_grpo.errors import CheckpointError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MODEL_OPTIM_DIR = "model_optim"
TRAINER_STATE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
COMPLETE_MARKER = "complete.json"
LATEST_FILE = "latest"
RNG_DIR = "rng"
RUN_FILE = "run.json"  # trainer/state/run_folder.py writes it
STEP_DIR = re.compile(r"^step_(\d+)$")
INITIAL_MODEL_DIR = "initial_model"  # beside checkpoints/ in a run folder: the HF folder the run started from
LEFTOVER_PREFIXES = (".tmp-", ".trash-")  # an interrupted save / deletion
# trainer_state.json's optimizer_format: the distributed optimizer's sharding type, or this for a
# non-distributed megatron optimizer (state keyed like the model)
MODEL_SPACE = "model_space"
# optimizer formats that load at any TP/PP
LAYOUT_RESHARDABLE = ("fully_sharded_model_space", "fully_reshardable", MODEL_SPACE)


def checkpoint_root(cfg) -> Path:
    return Path(cfg.checkpoint.save_dir or Path(cfg.logging.output_dir) / "checkpoints")


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> None:
    """Writes and fsyncs one file (one function, so tests can make every checkpoint write fail)."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def write_atomic(path: Path, data: bytes) -> None:
    """Replaces `path` atomically: a reader sees the old or the new content, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp")
    write_file(tmp, data)
    os.replace(tmp, path)
    fsync_path(path.parent)


@dataclass(frozen=True)
class Found:
    path: Path
    step: int


def validate_checkpoint(path: Path) -> str | None:
    """Why the step folder `path` is not loadable, or None when it is complete: the marker parses,
    names this step, and every recorded file has its recorded size."""
    marker = path / COMPLETE_MARKER
    if not marker.is_file():
        return f"no {COMPLETE_MARKER} (the save did not finish)"
    try:
        info = json.loads(marker.read_text())
        step, files = int(info["step"]), dict(info["files"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{COMPLETE_MARKER} is unreadable ({type(exc).__name__}: {exc})"
    match = STEP_DIR.match(path.name)
    if match and int(match.group(1)) != step:
        return f"{COMPLETE_MARKER} says step {step}, the folder name says {match.group(1)}"
    for rel, size in files.items():
        target = path / rel
        if not target.is_file():
            return f"{rel} is missing"
        if target.stat().st_size != size:
            return f"{rel} has {target.stat().st_size} bytes, {size} were written"
    return None


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """step_N folders under root, newest first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found, reverse=True)


def complete_checkpoints(cfg) -> list[Found]:
    """The checkpoints checkpoint.resume lets a run try, best first, after warning about every
    one that is skipped (`never`: none; a path: that one, which must be complete)."""
    resume = cfg.checkpoint.resume.strip()
    if resume == "never":
        return []
    if resume not in ("auto", "force"):
        path = Path(resume)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint.resume={resume}: no such checkpoint folder")
        problem = validate_checkpoint(path)
        if problem:
            raise CheckpointError(f"checkpoint.resume={resume}: not a complete checkpoint: {problem}")
        return [Found(path, int(json.loads((path / COMPLETE_MARKER).read_text())["step"]))]
    root = checkpoint_root(cfg)
    if root.is_dir():
        for leftover in sorted(p for p in root.iterdir() if p.name.startswith(LEFTOVER_PREFIXES)):
            log.warning("checkpoint: ignoring %s (an interrupted save or deletion; removed at the next save)", leftover)
    out = []
    for step, path in list_checkpoints(root):
        problem = validate_checkpoint(path)
        if problem:
            log.warning("checkpoint: skipping %s: %s", path, problem)
        else:
            out.append(Found(path, step))
    return out
