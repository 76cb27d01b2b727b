"""Which checkpoint a run continues from, checked completely before anything is restored.

Rank 0 runs two checks from setup.build_run, both before the policy is built:
  1. check_definitions, before initial_model/ is (re)built: every complete checkpoint the resume
     may load must come from a run with the same definition (run_folder.DEFINING_KEYS: model,
     data, task, seeds). A difference is a RunFolderError naming the keys (exit 2) unless
     checkpoint.resume=force. A folder whose checkpoints are all incomplete or unreadable holds a
     run this one cannot continue: refused the same way (starting from step 0 would overwrite it).
  2. check_restorable, once the model config and the prompts are known: the model's
     layout-independent shapes (never forceable: the weights would not fit), the prompt sampler
     (same prompts and seed; a changed data.train_batch_size continues at the same prompt), and
     whether the optimizer state can be resharded to this layout. What else changed (lr, clip,
     KL, batch sizes, layout) is listed; the resume applies the new values and logs the list.
The result, a list of checked Candidates, is what Checkpointer.resume loads (trainer/state/checkpoint.py).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from megatron_grpo.checkpointing import layout
from megatron_grpo.checkpointing.layout import LAYOUT_RESHARDABLE, MODEL_SPACE, RUN_FILE
from megatron_grpo.config.schema import Config
from megatron_grpo.errors import CheckpointError
from megatron_grpo.trainer.state.run_folder import (
    DEFINING_KEYS,
    RunFolderError,
    differences,
    earlier_run,
    flat_config,
    run_definition,
)

log = logging.getLogger(__name__)

# Changes that are not worth a line in the resume log.
_UNLOGGED_PREFIXES = ("logging.", "checkpoint.resume")


@dataclass(frozen=True)
class Candidate:
    path: Path
    step: int
    trainer_state: dict
    saved_config: dict            # the checkpoint's config.yaml, as plain dicts
    record: dict | None           # its run.json; None for checkpoints written before run records
    sampler_state: dict | None = None   # what the sampler continues from (None: from the start)
    changes: tuple[str, ...] = ()       # settings that differ from the saving run's


def forcing(cfg: Config) -> bool:
    return cfg.checkpoint.resume.strip() == "force"


def explicit(cfg: Config) -> bool:
    return cfg.checkpoint.resume.strip() not in ("auto", "force", "never")


# ----------------------------------------------------------------------------- 1. definitions


def check_definitions(cfg: Config) -> list[Candidate]:
    """Rank 0: the complete checkpoints the resume may load, best first, each read and checked
    against this run's definition. Unreadable ones are skipped with a warning (an explicit
    checkpoint.resume=PATH raises instead)."""
    definition = run_definition(cfg)
    if explicit(cfg):
        _check_destination(cfg, definition)
    candidates = []
    for found in layout.complete_checkpoints(cfg):
        try:
            candidate = _read(found)
        except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError) as exc:
            problem = f"{found.path}: unreadable ({type(exc).__name__}: {exc})"
            if explicit(cfg):
                raise CheckpointError(f"checkpoint.resume={cfg.checkpoint.resume}: {problem}") from None
            log.warning("checkpoint: skipping %s", problem)
            continue
        changed = differences(recorded_definition(candidate), definition)
        if changed and not forcing(cfg):
            raise RunFolderError(
                f"{candidate.path} was written by another run ({'; '.join(changed)}): use another "
                f"logging.output_dir, checkpoint.resume=force to continue from it anyway, or "
                f"checkpoint.resume=never logging.overwrite=true to move that run aside")
        if changed:
            log.warning("checkpoint: checkpoint.resume=force: continuing from %s although %s", candidate.path,
                        "; ".join(changed))
        candidates.append(candidate)
    if not candidates and cfg.checkpoint.resume.strip() in ("auto", "force"):
        _check_nothing_to_continue(cfg)
    return candidates


def _check_nothing_to_continue(cfg: Config) -> None:
    """A folder whose checkpoints are all incomplete or unreadable holds a run this one cannot
    continue: starting from step 0 there would overwrite its metrics and checkpoints. Refused as
    another run's folder is (RunFolderError, exit 2), unless checkpoint.resume=force."""
    root = layout.checkpoint_root(cfg).expanduser().resolve()
    steps = layout.list_checkpoints(root)
    if not steps:
        return
    out = Path(cfg.logging.output_dir).expanduser().resolve()
    problems = "; ".join(f"{path.name}: {layout.validate_checkpoint(path) or 'unreadable'}" for _, path in steps)
    held = f"{out} holds an earlier run ({earlier_run(out, root)}) but no checkpoint it can continue from ({problems})"
    if forcing(cfg):
        log.warning("checkpoint: checkpoint.resume=force: %s; starting from step 0, its metrics and checkpoints "
                    "are overwritten", held)
        return
    raise RunFolderError(f"{held}: starting from step 0 would overwrite it; use another logging.output_dir, "
                         f"checkpoint.resume=never logging.overwrite=true to move that run aside, or "
                         f"checkpoint.resume=force to start from step 0 over it")


def _check_destination(cfg: Config, definition: dict[str, Any]) -> None:
    """Resuming from a checkpoint of another folder: this run's checkpoints go to its own
    checkpoint folder, which must not hold another run's (newest complete one checked)."""
    newest = layout.complete_checkpoints(replace(cfg, checkpoint=replace(cfg.checkpoint, resume="auto")))[:1]
    for found in newest:
        try:
            changed = differences(recorded_definition(_read(found)), definition)
        except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
            continue  # unreadable: not loaded, and replaced by this run's save of that step
        if changed:
            raise RunFolderError(f"this run saves into {found.path.parent}, which holds checkpoints of another run "
                                 f"({'; '.join(changed)}): use another logging.output_dir or checkpoint.save_dir")


def recorded_definition(candidate: Candidate) -> dict[str, Any]:
    if candidate.record is not None:
        return dict(candidate.record["definition"])
    return run_definition(candidate.saved_config)  # written before run.json existed


def _read(found: layout.Found) -> Candidate:
    trainer_state = json.loads((found.path / layout.TRAINER_STATE).read_text())
    if not isinstance(trainer_state, dict) or int(trainer_state["step"]) != found.step:
        raise ValueError(f"{layout.TRAINER_STATE} does not describe step {found.step}")
    saved_config = yaml.safe_load((found.path / layout.CONFIG_FILE).read_text())
    if not isinstance(saved_config, dict):
        raise ValueError(f"{layout.CONFIG_FILE} is not a mapping")
    run_file = found.path / RUN_FILE
    record = json.loads(run_file.read_text()) if run_file.is_file() else None
    return Candidate(found.path, found.step, trainer_state, saved_config, record)


# ----------------------------------------------------------------------------- 2. restorable


def check_restorable(cfg: Config, candidates: list[Candidate], shapes: dict[str, Any], num_prompts: int,
                     layout: dict[str, int]) -> list[Candidate]:
    """Rank 0: each candidate checked against what this run built; returns them with the
    sampler state to continue from and the list of changed settings."""
    checked = []
    for candidate in candidates:
        _check_shapes(candidate, shapes)
        _check_optimizer_layout(cfg, candidate, layout)
        sampler_state, sampler_note = _continue_sampler(cfg, candidate, num_prompts)
        changes = settings_changes(candidate.saved_config, cfg)
        if sampler_note:
            changes.append(sampler_note)
        checked.append(replace(candidate, sampler_state=sampler_state, changes=tuple(changes)))
    return checked


def settings_changes(saved_config: dict, cfg: Config) -> list[str]:
    """Changed settings other than the defining ones (those are checked, or forced, above)."""
    def listed(key: str) -> bool:
        defining = key in DEFINING_KEYS or key.startswith(tuple(f"{k}." for k in DEFINING_KEYS))
        return not defining and not key.startswith(_UNLOGGED_PREFIXES)

    before = {k: v for k, v in flat_config(saved_config).items() if listed(k)}
    now = {k: v for k, v in flat_config(cfg).items() if listed(k)}
    # A key the saving run's schema did not have yet, now at its default, is no change.
    defaults = flat_config(Config())
    now = {k: v for k, v in now.items() if k in before or k not in defaults or v != defaults[k]}
    return differences(before, now)


def _check_shapes(candidate: Candidate, shapes: dict[str, Any]) -> None:
    if candidate.record is None:
        return  # older checkpoint: its config.yaml defines the same model (checked above)
    changed = differences(candidate.record["shapes"], shapes)
    if changed:
        raise RunFolderError(f"{candidate.path} holds a model of other shapes ({'; '.join(changed)}); its weights "
                             f"cannot be loaded into this one, even with checkpoint.resume=force")


def saved_optimizer_format(candidate: Candidate) -> str:
    """How the checkpoint's optimizer state is laid out ('model_space' for a non-distributed
    optimizer). Checkpoints of format 1 did not record it: they used dp_reshardable."""
    fmt = candidate.trainer_state.get("optimizer_format")
    if fmt:
        return fmt
    distributed = candidate.saved_config.get("parallel", {}).get("use_distributed_optimizer", True)
    return "dp_reshardable" if distributed else MODEL_SPACE


def _check_optimizer_layout(cfg: Config, candidate: Candidate, layout: dict[str, int]) -> None:
    saved_format = saved_optimizer_format(candidate)
    saved_distributed = saved_format != MODEL_SPACE
    if saved_distributed != cfg.parallel.use_distributed_optimizer:
        raise RunFolderError(
            f"{candidate.path} holds a {'distributed' if saved_distributed else 'non-distributed'} optimizer "
            "state; this run has "
            f"parallel.use_distributed_optimizer={str(cfg.parallel.use_distributed_optimizer).lower()}"
            f" (set it back to resume)")
    if saved_format in LAYOUT_RESHARDABLE:
        return
    saved = candidate.trainer_state.get("layout", {})
    saved_vpp = candidate.saved_config.get("parallel", {}).get("virtual_pipeline")
    now = {"tp": layout["tp"], "pp": layout["pp"], "vpp": cfg.parallel.virtual_pipeline}
    before = {"tp": saved.get("tp"), "pp": saved.get("pp"), "vpp": saved.get("vpp", saved_vpp)}
    if before != now:
        raise RunFolderError(
            f"{candidate.path} was saved at parallel.tensor={before['tp']} pipeline={before['pp']} "
            f"virtual_pipeline={before['vpp']} with its distributed-optimizer state in megatron's "
            f"'{saved_format}' format, which loads only at the same TP x PP (any DP); resume with that layout")


def _continue_sampler(cfg: Config, candidate: Candidate, num_prompts: int) -> tuple[dict | None, str]:
    """The sampler state to load, and a note for the changes list ('' when nothing to say)."""
    saved = candidate.trainer_state.get("sampler")
    if saved is None:
        return None, ""
    expected = {"seed": cfg.data.seed if cfg.data.seed is not None else cfg.trainer.seed,
                "num_items": num_prompts, "shuffle": cfg.data.shuffle, "drop_last": True}
    changed = [f"{key}: {saved.get(key)!r} -> {value!r}" for key, value in expected.items() if saved.get(key) != value]
    if changed:
        problem = f"the prompt sampler of {candidate.path} does not fit these prompts ({'; '.join(changed)})"
        if not forcing(cfg):
            raise RunFolderError(f"{problem}: the data changed (data.train_files content, data.max_prompt_length or "
                                 f"data.truncation?); checkpoint.resume=force starts the sampler over")
        return None, f"sampler: starts over ({problem})"
    return continue_at_batch_size(saved, cfg.data.train_batch_size)


def continue_at_batch_size(saved: dict, batch_size: int) -> tuple[dict, str]:
    """A sampler state saved at one batch size, continued at another: the first batch starts at
    the first prompt of the epoch not yet drawn, rounded up to whole batches of the new size (so
    no prompt is drawn twice in an epoch; up to batch_size - 1 are skipped)."""
    old = int(saved["batch_size"])
    if old == batch_size:
        return dict(saved), ""
    drawn = int(saved["batch_in_epoch"]) * old
    batch = -(-drawn // batch_size)
    note = (f"sampler: epoch {saved['epoch']} had {drawn} prompts drawn in batches of {old}; continues with batch "
            f"{batch} of size {batch_size}" + (f" (skipping {batch * batch_size - drawn} prompts)"
                                               if batch * batch_size != drawn else ""))
    return {**saved, "batch_size": batch_size, "batch_in_epoch": batch}, note
