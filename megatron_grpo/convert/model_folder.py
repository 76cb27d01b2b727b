"""model.path may name a `convert hf-to-megatron` checkpoint instead of an HF folder.

The trainer, its tokenizer and the rollout engine (local, or SGLang servers started from a folder)
all work on an HF folder, so the checkpoint is exported once, at the run's own TP x PP layout,
into <output_dir>/initial_model: config.json and the tokenizer from the checkpoint's hf_assets/,
the weights from its torch_dist shards. The original HF model is not needed (nor read). The
folder records what it was made from (SOURCE_RECORD) and is rebuilt when that checkpoint changes.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch.distributed as dist

from megatron_grpo.checkpointing.layout import INITIAL_MODEL_DIR
from megatron_grpo.convert.sources import is_convert_checkpoint, resolve_source
from megatron_grpo.launch.collectives import broadcast_from_rank0

SOURCE_RECORD = "megatron_source.json"


def hf_model_folder(model_path: str | Path, output_dir: str | Path) -> Path:
    """The HF folder the run starts from for model.path: the path itself when it is not a
    convert checkpoint (HF folder or hub id, as before); else <output_dir>/initial_model,
    exported from the checkpoint when missing or made from another one. Call it on every rank
    after initialize_model_parallel (the export is a collective over the run's layout)."""
    model_path = Path(model_path)
    if not is_convert_checkpoint(model_path):
        return model_path
    target = Path(output_dir) / INITIAL_MODEL_DIR
    record = source_record(model_path)
    stale = None
    if dist.get_rank() == 0:
        stale = _read_record(target) != record or not (target / "config.json").is_file()
    if broadcast_from_rank0(stale):
        _export_into(model_path, target, record)
    return target


def source_record(ckpt: Path) -> dict:
    """What identifies a convert checkpoint's content: its path, model config and shard index."""
    from megatron_grpo.convert.torch_dist_files import WEIGHTS_DIR
    from megatron_grpo.models.hf_config import MODEL_CONFIG_FILE

    digest = hashlib.sha256()
    for part in (ckpt / MODEL_CONFIG_FILE, ckpt / WEIGHTS_DIR / ".metadata"):
        digest.update(part.read_bytes() if part.is_file() else b"<missing>")
    return {"checkpoint": str(ckpt.resolve()), "sha256": digest.hexdigest()}


def _read_record(target: Path) -> dict | None:
    try:
        return json.loads((target / SOURCE_RECORD).read_text())
    except (OSError, ValueError):
        return None


def _export_into(ckpt: Path, target: Path, record: dict) -> None:
    from megatron_grpo.convert.to_hf import check_layout_fits, export_checkpoint_to_hf
    from megatron_grpo.models.builder import current_layout

    source = resolve_source(ckpt)
    layout = current_layout()
    check_layout_fits(source.model_config, layout.tensor, layout.pipeline, f"model.path={ckpt}",
                      names=("parallel.tensor", "parallel.pipeline"))
    export_checkpoint_to_hf(source, target, layout=layout, overwrite=True)
    if dist.get_rank() == 0:  # written last: a crash before it means "export again"
        (target / SOURCE_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    dist.barrier()
