"""Write a stream of HF-named tensors as an HF safetensors folder, atomically (disk weight sync)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable

import torch

# Non-weight files an engine needs to (re)load a folder; copied from the original checkpoint.
_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


def write_hf_folder(named_tensors: Iterable[tuple[str, torch.Tensor]], folder: str | Path,
                    side_files_from: str | Path | None = None, max_shard_bytes: int = 2 * 1024**3) -> tuple[Path, int]:
    """Writes model-0000k-of-0000n.safetensors shards + model.safetensors.index.json into `folder`
    via a temporary sibling and a rename, so a reader never sees a half-written folder.

    Returns (folder, bytes written). Tensors are written as given (dtype, shape, name)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards: list[dict[str, torch.Tensor]] = []
    current: dict[str, torch.Tensor] = {}
    size = total = 0
    seen_storage: set[int] = set()

    def flush() -> None:
        nonlocal current, size
        if current:
            index = len(shards)
            save_file(current, str(tmp / f"shard-{index}.safetensors"), metadata={"format": "pt"})
            shards.append({name: torch.empty(0) for name in current})  # keep names only
            current, size = {}, 0

    for name, tensor in named_tensors:
        if name in current or any(name in s for s in shards):
            raise ValueError(f"write_hf_folder: tensor {name!r} given twice")
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.untyped_storage().data_ptr() in seen_storage:  # safetensors refuses shared storage
            tensor = tensor.clone()
        seen_storage.add(tensor.untyped_storage().data_ptr())
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            flush()
        current[name] = tensor
        size += nbytes
        total += nbytes
    flush()
    count = len(shards)
    weight_map = {}
    for index, names in enumerate(shards):
        final = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
        os.replace(tmp / f"shard-{index}.safetensors", tmp / final)
        weight_map.update({name: final for name in names})
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    if side_files_from is not None:
        for fname in _SIDE_FILES:
            if (Path(side_files_from) / fname).is_file():
                shutil.copy2(Path(side_files_from) / fname, tmp / fname)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder, total
