"""One run folder, one run: what defines a run, recorded where a later start can check it.

<output_dir>/run.json (and a copy in every checkpoint) records what defines the run: the model
(path, config, tokenizer, override_config), the data (files or synthetic task), the reward
function, the seeds, and the model's layout-independent shapes. Everything else in the config
(learning rate, clipping, KL, batch sizes, the parallel layout) may change between two lives of
a run: a resume applies the new values (resume_plan.py).

Rules applied here, by rank 0, before any model is built:
  * logging.output_dir (and checkpoint.save_dir) must be creatable, writable folders.
  * a training run holds them (run_lock.py) before it writes anything there: a second start into a
    folder that a live run holds stops with one line naming that run (exit 2).
  * checkpoint.resume=never into a folder that holds a run (checkpoints or metrics) is refused,
    unless logging.overwrite=true, which renames that run to <folder>.old-N (never deletes it).
  * <output_dir>/initial_model (a model initialised from trainer.seed) records what it was
    built from (INIT_RECORD); setup.py rebuilds it when that changes.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping

from megatron_grpo.checkpointing.layout import RUN_FILE, checkpoint_root, list_checkpoints, write_atomic
from megatron_grpo.config import to_dict
from megatron_grpo.config.schema import Config
from megatron_grpo.errors import ConfigError
from megatron_grpo.trainer.metrics import METRICS_FILE
from megatron_grpo.trainer.state.run_lock import HeldFolders, lock_folder

log = logging.getLogger(__name__)

RECORD_FORMAT = 1
INIT_RECORD = "initialized_from.json"  # inside initial_model/

# The config keys that define a run (dotted; mappings are compared key by key).
DEFINING_KEYS = (
    "model.path", "model.config_path", "model.tokenizer_path", "model.override_config",
    "data.train_files", "data.task", "data.task_kwargs", "data.prompt_key", "data.reward_fn_key",
    "data.chat_template", "data.shuffle", "data.seed", "reward.function", "trainer.seed",
)
_PATH_KEYS = ("model.path", "model.config_path", "model.tokenizer_path", "data.train_files")
# The model's shapes that do not depend on the parallel layout (models.ModelArchitecture fields; the
# padded vocabulary depends on TP, so the HF vocabulary is recorded instead).
SHAPE_FIELDS = ("architecture", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "num_query_groups", "head_dim", "vocab_size", "tie_word_embeddings", "qkv_bias", "qk_norm")


class RunFolderError(ConfigError):
    """The run folder does not fit this config (exit code 2, one line)."""


# ----------------------------------------------------------------------------- the record


def run_definition(config: Config | Mapping[str, Any]) -> dict[str, Any]:
    """The defining keys of a config (a Config, or its saved plain-dict form), flattened to
    dotted keys, local paths made absolute."""
    data = to_dict(config) if isinstance(config, Config) else config
    values: dict[str, Any] = {}
    for key in DEFINING_KEYS:
        value = data
        for part in key.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if key in _PATH_KEYS:
            value = [_absolute(v) for v in value] if isinstance(value, list) else _absolute(value)
        values[key] = value
    return _flatten(_json_plain(values))


def model_shapes(model_config) -> dict[str, Any]:
    """Layout-independent shapes of a models.ModelArchitecture."""
    return {name: getattr(model_config, name) for name in SHAPE_FIELDS}


def run_record(config: Config, model_config) -> dict[str, Any]:
    return {"format": RECORD_FORMAT, "definition": run_definition(config), "shapes": model_shapes(model_config)}


def write_run_record(output_dir: Path, record: Mapping[str, Any]) -> None:
    """Rank 0: <output_dir>/run.json, replaced atomically."""
    write_atomic(Path(output_dir) / RUN_FILE, (json.dumps(record, indent=1) + "\n").encode())


def differences(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """'key: old -> new' for every flat key whose value differs (absent = '(unset)')."""
    out = []
    for key in sorted(set(before) | set(now)):
        old, new = before.get(key, _UNSET), now.get(key, _UNSET)
        if old != new:
            out.append(f"{key}: {_show(old)} -> {_show(new)}")
    return out


def flat_config(config: Config | Mapping[str, Any]) -> dict[str, Any]:
    """Every config key, dotted (mappings flattened too), JSON-plain values."""
    return _flatten(_json_plain(to_dict(config) if isinstance(config, Config) else dict(config)))


_UNSET = object()


def _show(value: Any) -> str:
    return "(unset)" if value is _UNSET else json.dumps(value)


def _absolute(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    path = Path(value).expanduser()
    return str(path.resolve()) if path.exists() else value


def _json_plain(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# ----------------------------------------------------------------------------- the folder


def prepare_output_dir(cfg: Config, hold: bool = False) -> HeldFolders | None:
    """Rank 0: makes logging.output_dir (and checkpoint.save_dir) usable for this run, or raises
    RunFolderError. With checkpoint.resume=never, an earlier run there is refused or moved aside.
    hold=True (a training run): takes their locks first (run_lock.py) and returns them, held until
    released; a folder another live run holds is refused (RunFolderBusy) before anything is written."""
    out = Path(cfg.logging.output_dir).expanduser().resolve()
    root = checkpoint_root(cfg).expanduser().resolve()
    folders = [("logging.output_dir", out)]
    if cfg.checkpoint.save_dir:
        folders.append(("checkpoint.save_dir", root))
    for key, folder in folders:
        _refuse_file_in_path(key, folder)
    held = _hold(folders) if hold else None
    try:
        if cfg.checkpoint.resume.strip() == "never" and _start_afresh(cfg, out, root) and held is not None:
            held.release()  # their locks went with the folders moved aside
            held = _hold(folders)
        for key, folder in folders:
            _writable_folder(key, folder)
    except BaseException:
        if held is not None:
            held.release()
        raise
    return held


def _hold(folders: list[tuple[str, Path]]) -> HeldFolders:
    held = HeldFolders()
    try:
        for key, folder in folders:
            if any(lock.folder == folder for lock in held.locks):  # checkpoint.save_dir = logging.output_dir
                continue
            _create_folder(key, folder)
            try:
                held.locks.append(lock_folder(key, folder))
            except OSError as exc:
                raise RunFolderError(f"{key}={folder} is not writable ({exc.strerror or exc})") from None
    except BaseException:
        held.release()
        raise
    return held


def earlier_run(out: Path, root: Path) -> str:
    """What of an earlier run `out` (and the checkpoint root) holds, in words; '' = nothing."""
    held = []
    steps = [p.name for _, p in list_checkpoints(root)]
    if steps:
        held.append(f"checkpoints {', '.join(reversed(steps))} in {root}")
    metrics = out / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size > 0:
        held.append(str(metrics))
    return " and ".join(held)


def _start_afresh(cfg: Config, out: Path, root: Path) -> bool:
    """True when an earlier run was moved aside."""
    held = earlier_run(out, root)
    if not held:
        return False
    if not cfg.logging.overwrite:
        raise RunFolderError(
            f"checkpoint.resume=never, but {out} holds an earlier run ({held}): use another "
            f"logging.output_dir, checkpoint.resume=auto to continue that run, or logging.overwrite=true "
            f"to move it aside")
    moved = [(out, _move_aside(out))] if out.exists() else []
    if root.exists() and out not in root.parents:
        moved.append((root, _move_aside(root)))
    for old, new in moved:
        log.warning("run folder: moved the earlier run %s to %s (checkpoint.resume=never, logging.overwrite=true)",
                    old, new)
    return bool(moved)


def _move_aside(folder: Path) -> Path:
    cwd = Path.cwd().resolve()
    if cwd == folder or folder in cwd.parents:
        raise RunFolderError(f"logging.overwrite=true would move {folder}, which holds the current folder "
                             f"{cwd}; choose another logging.output_dir")
    index = 1
    while (target := folder.with_name(f"{folder.name}.old-{index}")).exists():
        index += 1
    os.rename(folder, target)
    return target


def _refuse_file_in_path(key: str, folder: Path) -> None:
    for path in (folder, *folder.parents):
        if path.exists():
            if not path.is_dir():
                what = "is a file" if path == folder else f"is under {path}, which is a file"
                raise RunFolderError(f"{key}={folder} {what}, not a folder")
            return


def _create_folder(key: str, folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunFolderError(f"{key}={folder}: cannot create the folder ({exc.strerror or exc})") from None


def _writable_folder(key: str, folder: Path) -> None:
    _create_folder(key, folder)
    probe = folder / f".write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise RunFolderError(f"{key}={folder} is not writable ({exc.strerror or exc})") from None


# ----------------------------------------------------------------------------- initial_model/


def initial_model_record(cfg: Config) -> dict[str, Any]:
    """What setup._write_initial_model builds <output_dir>/initial_model from."""
    m = cfg.model
    return _json_plain({"config_path": _absolute(m.config_path), "override_config": dict(m.override_config),
                        "tokenizer": _absolute(m.tokenizer_path) if m.tokenizer_path else "synthetic",
                        "seed": cfg.trainer.seed})


def read_initial_model_record(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / INIT_RECORD).read_text())
    except (OSError, ValueError):
        return None
