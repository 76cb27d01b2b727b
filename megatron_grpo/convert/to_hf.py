"""Megatron weights -> an HF model folder: from a checkpoint on disk (`export`, `convert
megatron-to-hf`), or from the live policy of a run (`write_hf_export`, for checkpoint.save_hf).

Both are collectives over every rank of the current process group: each rank loads / holds its
TP x PP shard, global rank 0 receives the full tensors (in buckets, convert/export.py) and writes the folder
(HFWriter: safetensors shards, config.json, tokenizer files, generation_config.json), atomically.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_grpo.convert.sources import MegatronSource
from megatron_grpo.convert.torch_dist_files import stored_model_dtype
from megatron_grpo.convert.writer import DEFAULT_MAX_SHARD_BYTES, HFWriter
from megatron_grpo.errors import CheckpointError, ConfigError
from megatron_grpo.launch.collectives import agree, attempt_on_rank0
from megatron_grpo.models.hf_config import ModelArchitecture

HF_SUBDIR = "hf"  # <step_dir>/hf with checkpoint.save_hf=true


def check_layout_fits(cfg: ModelArchitecture, tp: int, pp: int, where: str,
                      names: tuple[str, str] = ("--tp", "--pp")) -> None:
    """The model splits over `tp` x `pp` ranks; else one ConfigError naming the option (`names`)
    and the model (`where`), instead of megatron's assertion deep in model building."""
    tp_name, pp_name = names
    if pp < 1 or tp < 1:
        raise ConfigError(f"{tp_name} {tp} / {pp_name} {pp}: expected integers >= 1")
    if cfg.num_layers % pp:
        raise ConfigError(f"{pp_name} {pp}: {where} has {cfg.num_layers} layers (num_hidden_layers), which do not "
                          f"divide into {pp} pipeline stages; use a pipeline size that divides {cfg.num_layers}")
    try:
        cfg.check_tensor_parallel(tp)
    except ConfigError as exc:
        raise ConfigError(f"{tp_name} {tp}: {where}: {exc}") from None


def export_checkpoint_to_hf(source: MegatronSource, out: Path, *, layout,
                            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False,
                            assets_dir: Path | None = None, progress: bool = False, merged: bool = False) -> Path:
    """Builds the model at `layout` (already initialised in megatron's parallel_state), loads the
    model tensors of `source` (not the optimizer), and writes the HF folder `out` on rank 0. A LoRA
    run's checkpoint: a PEFT adapter folder, or with `merged` the HF model with the adapters folded in."""
    from megatron_grpo.convert.export import gather_hf_weights_on_rank0
    from megatron_grpo.convert.megatron_checkpoint import load_model_weights
    from megatron_grpo.models import build_model

    cfg = source.model_config
    chunks = build_model(cfg, layout, dtype=stored_model_dtype(source.weights_dir))
    if source.lora is not None:
        from megatron_grpo.lora.attach import attach_adapters

        attach_adapters(chunks, cfg, source.lora)
    load_model_weights(chunks, source.weights_dir)
    if source.lora is not None and not merged:
        return _write_peft_folder(chunks, source, out, overwrite)
    assets = assets_dir if assets_dir is not None else source.assets_dir
    return write_hf_folder(gather_hf_weights_on_rank0(chunks, cfg), out, cfg, assets_dir=assets,
                           max_shard_bytes=max_shard_bytes, overwrite=overwrite, progress=progress)


def _write_peft_folder(chunks, source: MegatronSource, out: Path, overwrite: bool) -> Path:
    """The adapters as a PEFT folder, written beside `out` and renamed into place (nothing half-written)."""
    from megatron_grpo.lora.peft_folder import PeftAdapterConfig, gather_adapter_state, write_adapter_folder

    state = gather_adapter_state(chunks)
    if dist.get_rank() == 0:
        staging = out.with_name(out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        lora = source.lora
        write_adapter_folder(staging, state, PeftAdapterConfig(lora.rank, lora.alpha, lora.dropout,
                                                               lora.target_modules),
                             base_model=str(source.assets_dir or ""))
        if overwrite and out.exists():
            shutil.rmtree(out)
        elif out.is_dir():
            out.rmdir()  # empty: _check_output refused a non-empty one without --force
        staging.rename(out)
    dist.barrier()
    return out


def write_hf_export(model_chunks, cfg: ModelArchitecture, model_dir: str | Path, step_dir: str | Path) -> Path:
    """checkpoint.save_hf: writes <step_dir>/hf from live model chunks (config.json, tokenizer and
    generation config from `model_dir`, the HF folder the run started from). Call it on every
    rank, while step_dir is the checkpoint's staging folder, so complete.json covers the files and
    the rename publishes them with the step. Returns <step_dir>/hf (written by rank 0)."""
    from megatron_grpo.convert.export import gather_hf_weights_on_rank0

    out = Path(step_dir) / HF_SUBDIR
    stream = gather_hf_weights_on_rank0(model_chunks, cfg)
    return write_hf_folder(stream, out, cfg, assets_dir=Path(model_dir), overwrite=True)


def write_hf_folder(stream: Iterator[tuple[str, torch.Tensor]], out: Path, cfg: ModelArchitecture, *,
                    assets_dir: Path | None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                    overwrite: bool = False, progress: bool = False) -> Path:
    """Rank 0 writes the gathered tensors; every rank exhausts the stream. A write error on rank 0
    (disk full...) is raised only after the stream is drained, so no peer is left blocked in a
    send; then every rank raises it (launch.collectives.agree)."""
    outcome = None
    if dist.get_rank() == 0:
        outcome = attempt_on_rank0(_write_on_rank0, stream, out, cfg, assets_dir, max_shard_bytes, overwrite,
                                   progress)
    else:
        for _ in stream:
            pass
    error = agree(outcome, share_value=False).error
    if error is not None:
        raise error
    return out


def _write_on_rank0(stream: Iterator[tuple[str, torch.Tensor]], out: Path, cfg: ModelArchitecture,
                    assets_dir: Path | None, max_shard_bytes: int, overwrite: bool, progress: bool) -> None:
    """Writes the folder, draining the whole stream even after a failure, then raises it."""
    failure: BaseException | None = None
    writer = None
    try:
        writer = HFWriter(out, cfg, assets_dir=assets_dir, max_shard_bytes=max_shard_bytes, overwrite=overwrite)
    except CheckpointError as exc:
        failure = exc
    items = stream
    if progress:
        from tqdm import tqdm

        from megatron_grpo.convert.mappings import expected_hf_tensors

        items = tqdm(stream, total=len(expected_hf_tensors(cfg)), desc="export HF", unit="tensor")
    for name, tensor in items:
        if failure is None:
            try:
                writer.add(name, tensor)
            except (CheckpointError, OSError) as exc:
                failure = exc
    if writer is not None:
        try:
            writer.close() if failure is None else writer.abort()
        except (CheckpointError, OSError) as exc:
            failure = exc
    if isinstance(failure, CheckpointError):
        raise failure
    if failure is not None:
        raise CheckpointError(f"{out}: writing the HF folder failed ({type(failure).__name__}: {failure})")
