"""Write an HF model folder from a stream of (hf_name, tensor): sharded safetensors, the index,
config.json, and the generation config / tokenizer files copied from an assets folder. The one
writer of HF folders: exports (HFWriter) and the disk weight sync to SGLang (write_hf_folder).

    with HFWriter(out_dir, cfg, assets_dir=ckpt / "hf_assets") as writer:
        for name, tensor in gather_hf_weights_on_rank0(chunks, cfg):
            writer.add(name, tensor)

The folder is assembled in a temporary sibling and renamed into place on success, so a reader
never sees a half-written folder and a failed export leaves nothing behind. Shard names follow
transformers (model-00001-of-00003.safetensors; a single shard is model.safetensors, without an
index).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import save_file

from megatron_grpo.convert.hf_io import INDEX_FILE, SINGLE_FILE
from megatron_grpo.convert.mappings import expected_hf_tensors
from megatron_grpo.errors import CheckpointError
from megatron_grpo.models.hf_config import ModelArchitecture

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
# Files of an HF model folder that are not weights and not config.json: copied verbatim.
ASSET_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
               "chat_template.json", "preprocessor_config.json")
GENERATION_CONFIG = "generation_config.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def copy_hf_assets(src: str | Path, dst: str | Path, names: tuple[str, ...] = ASSET_FILES) -> list[str]:
    """Copies the files of `names` present in src to dst; returns their names."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in names:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def generation_config_from(cfg: ModelArchitecture) -> dict:
    """What transformers' GenerationConfig.from_model_config keeps of config.json (special token
    ids), for a source folder that had no generation_config.json."""
    keys = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
    return {"_from_model_config": True, **{k: cfg.hf_config[k] for k in keys if cfg.hf_config.get(k) is not None}}


def hf_config_dtype(cfg: ModelArchitecture) -> torch.dtype | None:
    """The dtype config.json declares for the weights (transformers 5: 'dtype'; 4: 'torch_dtype')."""
    name = cfg.hf_config.get("dtype") or cfg.hf_config.get("torch_dtype")
    if name is None:
        return None
    if name not in _DTYPES:
        raise CheckpointError(f"config.json dtype {name!r} is not supported ({sorted(_DTYPES)})")
    return _DTYPES[name]


def _default_permissions(folder: Path) -> None:
    """mkdtemp makes the folder 0700 and safetensors its files 0600: give the exported model the
    permissions of an ordinary folder (umask applied), so others on a shared cluster can read it."""
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for path in folder.iterdir():
        os.chmod(path, 0o666 & ~umask)


class SafetensorsFolder:
    """An HF-layout safetensors folder built tensor by tensor: shards of at most max_shard_bytes,
    the index, files copied from `assets_dir` (`assets`), then one rename into place. Tensors are
    written as given unless `dtype` is set; a name given twice is an error."""

    def __init__(self, out_dir: str | Path, *, assets_dir: str | Path | None = None,
                 assets: tuple[str, ...] = ASSET_FILES, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 dtype: torch.dtype | None = None, overwrite: bool = False):
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and any(self.out_dir.iterdir()) and not overwrite:
            raise CheckpointError(f"{self.out_dir}: output folder is not empty (use --force to overwrite)")
        self.assets_dir = Path(assets_dir) if assets_dir else None
        self.assets = assets
        self.max_shard_bytes = max_shard_bytes
        self.dtype = dtype
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.", dir=self.out_dir.parent))
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._pending_storages: set[int] = set()
        self._shards: list[list[str]] = []
        self._seen: set[str] = set()
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._seen:
            raise CheckpointError(f"HF writer: tensor {name!r} written twice")
        tensor = tensor.detach().to("cpu", self.dtype or tensor.dtype).contiguous()
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        # safetensors refuses tensors that share storage (tied weights given twice, views of a
        # larger buffer): those are copied.
        storage = tensor.untyped_storage()
        if storage.nbytes() != size or storage.data_ptr() in self._pending_storages:
            tensor = tensor.clone()
        self._pending_storages.add(tensor.untyped_storage().data_ptr())
        self._seen.add(name)
        self._pending[name] = tensor
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        index = len(self._shards)
        save_file(self._pending, str(self._tmp / f"shard-{index:05d}.tmp"), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes, self._pending_storages = {}, 0, set()

    def _write_extra_files(self) -> None:
        """Files beyond weights, index and assets (HFWriter: config.json, generation_config.json)."""

    def close(self) -> Path:
        if self._pending or not self._shards:
            self._flush()
        total = len(self._shards)
        weight_map = {}
        for i, names in enumerate(self._shards):
            final = SINGLE_FILE if total == 1 else f"model-{i + 1:05d}-of-{total:05d}.safetensors"
            os.replace(self._tmp / f"shard-{i:05d}.tmp", self._tmp / final)
            weight_map.update({name: final for name in names})
        if total > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": dict(sorted(weight_map.items()))}
            (self._tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        if self.assets_dir is not None:
            copy_hf_assets(self.assets_dir, self._tmp, self.assets)
        self._write_extra_files()
        _default_permissions(self._tmp)
        if self.out_dir.exists():
            shutil.rmtree(self.out_dir)
        os.replace(self._tmp, self.out_dir)
        return self.out_dir

    def abort(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()


class HFWriter(SafetensorsFolder):
    """The HF folder of one model: every tensor `cfg` expects, with its shape, in config.json's
    dtype (or `dtype`); config.json written from cfg, generation_config.json from the assets or
    cfg's special tokens."""

    def __init__(self, out_dir: str | Path, cfg: ModelArchitecture, *, assets_dir: str | Path | None = None,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, dtype: torch.dtype | None = None,
                 overwrite: bool = False):
        super().__init__(out_dir, assets_dir=assets_dir, max_shard_bytes=max_shard_bytes,
                         dtype=dtype if dtype is not None else hf_config_dtype(cfg), overwrite=overwrite)
        self.cfg = cfg
        self.expected = expected_hf_tensors(cfg)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.expected:
            raise CheckpointError(f"HF writer: unexpected tensor {name!r} for {self.cfg.architecture}")
        if tuple(tensor.shape) != self.expected[name]:
            raise CheckpointError(f"HF writer: {name} has shape {tuple(tensor.shape)}, config expects "
                                  f"{self.expected[name]}")
        super().add(name, tensor)

    def close(self) -> Path:
        missing = sorted(set(self.expected) - self._seen)
        if missing:
            self.abort()
            raise CheckpointError(f"HF writer: export incomplete, missing {missing[:10]}"
                                  + (f" and {len(missing) - 10} more" if len(missing) > 10 else ""))
        return super().close()

    def _write_extra_files(self) -> None:
        (self._tmp / "config.json").write_text(json.dumps(self.cfg.hf_config, indent=2, sort_keys=True) + "\n")
        if not (self._tmp / GENERATION_CONFIG).is_file():
            (self._tmp / GENERATION_CONFIG).write_text(json.dumps(generation_config_from(self.cfg), indent=2) + "\n")


def write_hf_folder(named_tensors: Iterable[tuple[str, torch.Tensor]], folder: str | Path, *,
                    side_files_from: str | Path | None = None,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> tuple[Path, int]:
    """A stream of HF-named tensors, written as given, as an HF folder that an engine can load:
    config.json and the ASSET_FILES copied from `side_files_from` (the disk weight sync).
    Replaces `folder`. Returns (folder, bytes of weights written)."""
    with SafetensorsFolder(folder, assets_dir=side_files_from, assets=("config.json", *ASSET_FILES),
                           max_shard_bytes=max_shard_bytes, overwrite=True) as writer:
        for name, tensor in named_tensors:
            writer.add(name, tensor)
    return Path(folder), writer.total_bytes
