"""Training checkpoints: the whole training state saved every K steps / on a stop signal, and the
best checkpoint of the run's resume plan restored.

The files of one checkpoint and what makes it complete: checkpointing/layout.py. Everything is
written under <save_dir>/.tmp-step_N, then renamed: a crash before the rename leaves only a
.tmp-step_N folder, which is never loaded (and removed by the next save); a crash after it leaves a
complete step_N. Whether a checkpoint belongs to this run, fits its model and data, and can be
resharded to its layout is checked before anything is restored (trainer/state/resume_plan.py); a
checkpoint that megatron then fails to read is skipped (if no older one loads, that is an error: DCP
reads into the live model in place, so a failed read leaves it half overwritten). Old checkpoints
(keep_last) are renamed to .trash-step_N before deletion. What happens around a restore (the
engine's weights, metrics.jsonl) is trainer/state/resume.py's.

Security: nothing here unpickles arbitrary objects. Our files are JSON, YAML and torch.load(...,
weights_only=True); megatron's torch_dist files are read with torch's DCP, whose byte-object
reader is switched to weights_only=True while we load (launch/safe_dcp.py).

Every function here is a collective over all ranks unless it says otherwise.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_grpo.checkpointing import layout
from megatron_grpo.checkpointing.layout import (COMPLETE_MARKER, CONFIG_FILE, FORMAT_VERSION, LATEST_FILE,
                                                LEFTOVER_PREFIXES, MODEL_OPTIM_DIR, MODEL_SPACE, RNG_DIR, RUN_FILE,
                                                TRAINER_STATE, checkpoint_root, fsync_path, list_checkpoints,
                                                step_dir_name, write_atomic)
from megatron_grpo.checkpointing.sharded import (READ_ERRORS, load_model_state, model_sharded_state_dict,
                                                 os_error_text, short_error)
from megatron_grpo.errors import CheckpointError
from megatron_grpo.launch.collectives import raise_if_any_failed

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- small helpers


def _rank_coordinates() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
            "cp": ps.get_context_parallel_rank(), "dp": ps.get_data_parallel_rank()}


def _rng_file(coords: dict[str, int]) -> str:
    return f"tp{coords['tp']}-pp{coords['pp']}-cp{coords['cp']}-dp{coords['dp']}.pt"


class PartlyReadError(CheckpointError):
    """Reading a checkpoint failed after part of it was written into the live model."""


# ----------------------------------------------------------------------------- state pieces


def training_sharded_state_dict(run, *, is_loading: bool, optimizer_format: str | None = None) -> dict:
    """Model chunks (checkpointing/sharded.py's keys) + "optimizer", as megatron sharded state
    dicts. Loading passes the format the checkpoint's optimizer state was saved in."""
    from megatron_grpo.launch import mcore_compat

    state = model_sharded_state_dict(run.policy)
    # Only a checkpoint in another distributed format than the one saved now asks for it by name.
    default = mcore_compat.DIST_OPTIMIZER_CKPT_METADATA["distrib_optim_sharding_type"]
    other = {} if optimizer_format in (None, default, MODEL_SPACE) else {"sharding_type": optimizer_format}
    state["optimizer"] = mcore_compat.optimizer_sharded_state_dict(_inner_optimizer(run.optimizer), dict(state),
                                                                   is_loading=is_loading, **other)
    return state


def optimizer_format(optimizer_state: dict) -> str:
    """The distributed optimizer's sharding type in a sharded optimizer state dict (per chained
    optimizer, which all use the same), or MODEL_SPACE for a non-distributed optimizer."""
    if "param_state_sharding_type" in optimizer_state:
        return str(optimizer_state["param_state_sharding_type"])
    for value in optimizer_state.values():
        if isinstance(value, dict) and "param_state_sharding_type" in value:
            return str(value["param_state_sharding_type"])
    return MODEL_SPACE


def _inner_optimizer(optimizer):
    """The megatron optimizer under our NonFiniteUpdateGuard (update_guard.py), if any."""
    return getattr(optimizer, "inner", optimizer)


def rng_state() -> dict:
    from megatron.core import tensor_parallel

    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]), int(np_state[3]),
                  float(np_state[4])],
        "torch": torch.get_rng_state(),
        "megatron_tracker": {k: v.cpu() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.set_states({k: v.clone() for k, v in state["megatron_tracker"].items()})


# ----------------------------------------------------------------------------- the checkpointer


@dataclass(frozen=True)
class Restored:
    """What a restore brought back: the checkpoint, its step, and the weight version the rollout
    engine held when it was saved (the version its weights are pushed as again)."""

    path: Path
    step: int
    engine_weight_version: int


class Checkpointer:
    """Saves and restores everything a run needs to continue exactly where it stopped."""

    def __init__(self, run):
        self.run = run
        self.cfg = run.config
        self.root = checkpoint_root(self.cfg)
        self.interval = self.cfg.checkpoint.save_interval
        self.keep_last = self.cfg.checkpoint.keep_last
        self.last_saved: Path | None = None

    # ----- saving -------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """A save is due every save_interval steps and after the last step (when saving is on)."""
        return self.interval > 0 and (step % self.interval == 0 or step == self.run.total_steps)

    def save(self, step: int) -> Path:
        """Writes step_N atomically; on any failure every rank raises CheckpointError and the
        previous checkpoints are untouched."""
        from megatron.core import dist_checkpointing

        rank = dist.get_rank()
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{step_dir_name(step)}"
        failure = None
        if rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                for leftover in self.root.iterdir():
                    if leftover.name.startswith(LEFTOVER_PREFIXES):
                        shutil.rmtree(leftover, ignore_errors=True)
                (tmp / RNG_DIR).mkdir(parents=True)
                (tmp / MODEL_OPTIM_DIR).mkdir()
            except OSError as exc:
                failure = self._failure(step, exc)
        raise_if_any_failed(failure, CheckpointError)

        try:
            state = training_sharded_state_dict(self.run, is_loading=False)
            dist_checkpointing.save(state, str(tmp / MODEL_OPTIM_DIR))
            if self.cfg.checkpoint.save_hf:  # a collective: every rank sends its shards to rank 0
                from megatron_grpo.convert.to_hf import write_hf_export

                write_hf_export(self.run.policy, self.run.model_config, self.run.model_dir, tmp)
            coords = _rank_coordinates()
            buffer = _torch_bytes(rng_state())
            layout.write_file(tmp / RNG_DIR / _rng_file(coords), buffer)
            # each rank makes its own megatron shard files durable; rank 0 the shared ones
            for shard in (tmp / MODEL_OPTIM_DIR).glob(f"__{rank}_*"):
                fsync_path(shard)
            if rank == 0:
                trainer_state = self._trainer_state(step, optimizer_format(state["optimizer"]))
                layout.write_file(tmp / TRAINER_STATE, json.dumps(trainer_state, indent=1).encode())
                from megatron_grpo.config import to_yaml

                layout.write_file(tmp / CONFIG_FILE, to_yaml(self.cfg).encode())
                layout.write_file(tmp / RUN_FILE, (json.dumps(self.run.record, indent=1) + "\n").encode())
        except READ_ERRORS as exc:  # noqa: BLE001 - turned into one CheckpointError on every rank
            failure = self._failure(step, exc)
        raise_if_any_failed(failure, CheckpointError)

        if rank == 0:
            try:
                for path in tmp.rglob("*"):
                    if path.is_file() and not path.name.startswith("__"):
                        fsync_path(path)
                files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
                marker = {"format": FORMAT_VERSION, "step": step, "world_size": dist.get_world_size(),
                          "files": files}
                layout.write_file(tmp / COMPLETE_MARKER, json.dumps(marker, indent=1).encode())
                for sub in [*(p for p in tmp.rglob("*") if p.is_dir()), tmp]:
                    fsync_path(sub)
                if final.exists():  # e.g. a corrupt step_N that resume skipped
                    trash = self.root / f".trash-{final.name}"
                    os.replace(final, trash)
                    shutil.rmtree(trash, ignore_errors=True)
                os.replace(tmp, final)
                fsync_path(self.root)
                write_atomic(self.root / LATEST_FILE, (final.name + "\n").encode())
            except Exception as exc:  # noqa: BLE001
                failure = self._failure(step, exc)
                if not final.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        raise_if_any_failed(failure, CheckpointError)
        if rank == 0:
            self._prune()
            log.info("checkpoint: saved %s", final)
        self.last_saved = final
        return final

    def _failure(self, step: int, exc: BaseException) -> str:
        if dist.get_rank() == 0:
            shutil.rmtree(self.root / f".tmp-{step_dir_name(step)}", ignore_errors=True)
        previous = [p.name for _, p in list_checkpoints(self.root)]
        kept = (f"the previous checkpoint {self.root / previous[0]} is intact" if previous
                else "no earlier checkpoint exists")
        return f"saving checkpoint step {step} to {self.root} failed: {save_failure_reason(exc)}; {kept}"

    def _trainer_state(self, step: int, optimizer_format: str) -> dict:
        run = self.run
        guard = run.optimizer if hasattr(run.optimizer, "inner") else None
        return {
            "format": FORMAT_VERSION,
            "step": step,
            "scheduler": run.scheduler.state_dict(),
            "sampler": run.sampler.state_dict() if run.is_main else None,
            # rollout.long_tail: prompts drawn but not started and carried partial groups (long_tail.py)
            "carry_over": run.carry_over.state_dict() if run.is_main and run.carry_over is not None else None,
            "engine_weight_version": run.engine.weight_version if run.is_main else step,
            "skipped_updates": guard.state_dict() if guard is not None else None,
            "kl_ctrl": run.kl_controller.state_dict() if run.kl_controller is not None else None,
            "layout": {"world_size": dist.get_world_size(), **_layout(),
                       "vpp": self.cfg.parallel.virtual_pipeline},
            "optimizer_format": optimizer_format,
        }

    def _prune(self) -> None:
        if not self.keep_last:
            return
        for _, path in list_checkpoints(self.root)[self.keep_last:]:
            trash = self.root / f".trash-{path.name}"
            os.replace(path, trash)
            shutil.rmtree(trash, ignore_errors=True)

    # ----- restoring ----------------------------------------------------------------------------
    def restore(self) -> Restored | None:
        """Restores the best checkpoint of run.resume_plan (checked by resume_plan.py before the
        model was built) and applies this config's hyperparameters on top; None when there is
        none to restore (a fresh start)."""
        from megatron_grpo.trainer.state.resume_plan import explicit

        half_read = []  # checkpoints whose read failed after writing into the live model
        for candidate in self.run.resume_plan:
            try:
                restored = self._load(candidate)
            except CheckpointError as exc:
                if explicit(self.cfg):
                    raise
                if dist.get_rank() == 0:
                    log.warning("checkpoint: skipping %s: %s", candidate.path, exc)
                if isinstance(exc, PartlyReadError):
                    half_read.append(f"{candidate.path} ({exc})")
                continue
            if dist.get_rank() == 0:
                log.info("checkpoint: resumed from %s (step %d)", candidate.path, restored.step)
                if candidate.changes:
                    log.info("checkpoint: changed since that checkpoint (the new values apply): %s",
                             "; ".join(candidate.changes))
            return restored
        if half_read:  # starting afresh would train a mix of initial and checkpoint weights
            raise CheckpointError(
                f"no checkpoint could be loaded, and reading {'; '.join(half_read)} overwrote part of the model "
                f"before failing, so the run cannot start from step 0 either: move the damaged checkpoint aside "
                f"(or start afresh with checkpoint.resume=never logging.overwrite=true)")
        if dist.get_rank() == 0 and self.cfg.checkpoint.resume.strip() in ("auto", "force"):
            log.info("checkpoint: no complete checkpoint under %s; starting from step 0", self.root)
        return None

    def _load(self, candidate) -> Restored:
        """Reads everything first; the live model is modified only once every read succeeded."""
        from megatron.core import dist_checkpointing

        from megatron_grpo.launch.cpu import fix_torch_adam_step_after_load, prepare_torch_adam_for_load
        from megatron_grpo.launch.safe_dcp import dcp_bytes_weights_only
        from megatron_grpo.trainer.state.resume_plan import saved_optimizer_format

        path, trainer_state = candidate.path, candidate.trainer_state
        failure, rng = None, None
        try:
            rng = self._read_rng(path, trainer_state)
        except READ_ERRORS as exc:  # noqa: BLE001 - a damaged file: skippable
            failure = f"{RNG_DIR}: {type(exc).__name__}: {exc}"
        raise_if_any_failed(failure, CheckpointError)

        optimizer = _inner_optimizer(self.run.optimizer)
        prepare_torch_adam_for_load(optimizer)
        hyperparameters = _param_group_hyperparameters(optimizer)  # this config's, before the load
        state = training_sharded_state_dict(self.run, is_loading=True,
                                            optimizer_format=saved_optimizer_format(candidate))
        try:  # DCP reads into the live parameters (and optimizer buffers) in place
            with dcp_bytes_weights_only():
                loaded = dist_checkpointing.load(state, str(path / MODEL_OPTIM_DIR))
        except READ_ERRORS as exc:  # noqa: BLE001 - megatron/DCP raise assorted errors for bad shards
            failure = f"cannot read {path / MODEL_OPTIM_DIR} ({short_error(exc)})"
        raise_if_any_failed(failure, PartlyReadError)

        # From here on failures are fatal, not skippable.
        load_model_state(self.run.policy, loaded)
        with torch.no_grad():  # megatron copies into views of leaf parameters
            optimizer.load_state_dict(loaded["optimizer"])
        fix_torch_adam_step_after_load(optimizer)
        # The checkpoint brings the optimizer's state and the schedule's position; lr, betas, eps,
        # weight decay and the schedule's shape come from this config (a changed lr applies).
        for group, values in zip(optimizer.param_groups, hyperparameters):
            group.update(values)
        self.run.scheduler.step(increment=int(trainer_state["scheduler"]["num_steps"]))
        if self.run.is_main and candidate.sampler_state is not None:
            self.run.sampler.load_state_dict(candidate.sampler_state)
            if self.run.carry_over is not None and trainer_state.get("carry_over") is not None:
                self.run.carry_over.load_state_dict(trainer_state["carry_over"])
        guard = self.run.optimizer if hasattr(self.run.optimizer, "inner") else None
        if guard is not None and trainer_state.get("skipped_updates"):
            guard.load_state_dict(trainer_state["skipped_updates"])
        if self.run.kl_controller is not None and trainer_state.get("kl_ctrl"):
            self.run.kl_controller.load_state_dict(trainer_state["kl_ctrl"])
        if rng is not None:
            set_rng_state(rng)
        step = int(trainer_state["step"])
        return Restored(path=path, step=step,
                        engine_weight_version=int(trainer_state.get("engine_weight_version", step)))

    def _read_rng(self, path: Path, trainer_state: dict) -> dict | None:
        coords = _rank_coordinates()
        exact = path / RNG_DIR / _rng_file(coords)
        if exact.is_file():
            return torch.load(exact, weights_only=True)
        # DP size changed: the replicas of one model-parallel rank hold the same model RNG
        same_model_rank = path / RNG_DIR / _rng_file({**coords, "dp": 0})
        if same_model_rank.is_file():
            return torch.load(same_model_rank, weights_only=True)
        if dist.get_rank() == 0:
            log.warning("checkpoint: %s has no RNG state for this layout (saved %s, now %s); RNG states start "
                        "fresh from trainer.seed", path, trainer_state.get("layout"), _layout())
        return None


def save_failure_reason(exc: BaseException) -> str:
    """Why a save failed, in one line. A full device or an unwritable folder is named also when
    megatron / torch DCP wrapped the OSError (CheckpointException, "Worker failure: ...")."""
    space = os_error_text(exc, (errno.ENOSPC, errno.EDQUOT))
    if space is not None:
        return f"no space left on the device ({space})"
    denied = os_error_text(exc, (errno.EACCES, errno.EROFS, errno.EPERM))
    if denied is not None:
        return f"folder not writable ({denied})"
    return short_error(exc)


def _param_group_hyperparameters(optimizer) -> list[dict]:
    """Every param group's settings except its parameters and Adam's step counter."""
    return [{k: v for k, v in group.items() if k not in ("params", "step")} for group in optimizer.param_groups]


def _layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "cp": ps.get_context_parallel_world_size(), "dp": ps.get_data_parallel_world_size()}


def _torch_bytes(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()
