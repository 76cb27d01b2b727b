"""A torch_dist folder (megatron dist_checkpointing's format) read without loading it: its files,
the shapes, dtype and shard sizes its .metadata records; and the folder names of a `convert
hf-to-megatron` checkpoint. Used by convert/sources.py (what a path holds) and
convert/megatron_checkpoint.py (loading), which both import from here."""
from __future__ import annotations

from pathlib import Path

from megatron_grpo.checkpointing.sharded import READ_ERRORS
from megatron_grpo.errors import CheckpointError

DIST_METADATA = "metadata.json"  # megatron dist_checkpointing's marker in a torch_dist folder
WEIGHTS_DIR = "model"  # a convert checkpoint's torch_dist folder
ASSETS_DIR = "hf_assets"  # its copy of the HF config and tokenizer files


def require_torch_dist(weights: Path) -> None:
    if not (weights / DIST_METADATA).is_file() or not (weights / ".metadata").is_file():
        raise CheckpointError(f"{weights}: not a complete torch_dist checkpoint (no {DIST_METADATA} / .metadata)")


def _torch_dist_metadata(weights: Path):
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(weights)).read_metadata()
    except READ_ERRORS as exc:
        raise CheckpointError(f"{weights / '.metadata'}: unreadable ({type(exc).__name__}: {exc})") from None


def stored_tensor_shapes(weights: Path) -> dict[str, tuple[int, ...]]:
    """Global shapes of the model tensors in a torch_dist folder (optimizer state left out)."""
    meta = _torch_dist_metadata(weights)
    return {key: tuple(md.size) for key, md in meta.state_dict_metadata.items()
            if not key.startswith("optimizer.") and hasattr(md, "size")}


def check_shard_sizes(weights: Path) -> None:
    """Every .distcp file holds the bytes .metadata places in it for the model tensors (a copy or
    download cut short otherwise fails deep inside torch's reader with a bare EOFError)."""
    meta = _torch_dist_metadata(weights)
    needed: dict[str, int] = {}
    for index, info in (meta.storage_data or {}).items():
        if not index.fqn.startswith("optimizer."):
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = weights / name
        if not path.is_file():
            raise CheckpointError(f"{path}: shard file missing (listed in {weights / '.metadata'})")
        if path.stat().st_size < size:
            raise CheckpointError(f"{path}: truncated shard file ({path.stat().st_size} bytes; "
                                  f"{weights / '.metadata'} places data up to byte {size})")


def stored_model_dtype(weights: Path):
    """The one float dtype the model tensors were saved in."""
    meta = _torch_dist_metadata(weights)
    dtypes = {md.properties.dtype for key, md in meta.state_dict_metadata.items()
              if not key.startswith("optimizer.") and hasattr(md, "properties")}
    if len(dtypes) != 1:
        raise CheckpointError(f"{weights / '.metadata'}: expected one dtype among the model tensors, found "
                              f"{sorted(map(str, dtypes))}")
    return dtypes.pop()
