"""Read access to an HF model folder's safetensors, one slice at a time.

    with HFCheckpoint("/models/Qwen3-8B") as ckpt:
        ckpt.validate(expected_hf_tensors(cfg))     # names and shapes, from headers only
        rows = ckpt.read("model.embed_tokens.weight", dim=0, start=0, stop=128)

Every problem (no safetensors, missing shard file, truncated or corrupt file, index pointing at
a tensor a file lacks, unexpected / missing tensors, wrong shapes) raises one CheckpointError
that names the file and tensor.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from megatron_grpo.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class HFCheckpoint:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: HF model folder not found")
        self._weight_map = self._read_weight_map()
        self._files = sorted(set(self._weight_map.values())) or [SINGLE_FILE]
        self._handles: dict[str, object] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for file in self._files:
            handle = self._open(file)
            keys = set(handle.keys())
            for name, mapped in self._weight_map.items():
                if mapped == file and name not in keys:
                    raise CheckpointError(f"{self.directory / INDEX_FILE}: maps {name!r} to {file}, "
                                          f"which does not contain it")
            for name in keys:
                if self._weight_map.get(name, file) != file:
                    continue  # duplicate in another file; the index decides
                self._weight_map.setdefault(name, file)
                self._shapes[name] = tuple(handle.get_slice(name).get_shape())

    def _read_weight_map(self) -> dict[str, str]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index ({exc!r})") from None
            missing = sorted({f for f in weight_map.values() if not (self.directory / f).is_file()})
            if missing:
                raise CheckpointError(f"{index}: shard file(s) missing from {self.directory}: {missing}")
            return dict(weight_map)
        if (self.directory / SINGLE_FILE).is_file():
            return {}  # filled from the file's header
        found = sorted(p.name for p in self.directory.iterdir() if p.suffix in (".bin", ".pt", ".safetensors"))
        raise CheckpointError(f"{self.directory}: neither {INDEX_FILE} nor {SINGLE_FILE} found"
                              + (f" (found {found}; only safetensors are supported)" if found else ""))

    @property
    def files(self) -> list[str]:
        return list(self._files)

    def _open(self, file: str):
        if file not in self._handles:
            path = self.directory / file
            try:
                self._handles[file] = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own SafetensorError for bad headers
                raise CheckpointError(f"{path}: unreadable safetensors file (truncated or corrupt?): {exc}") from None
        return self._handles[file]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self._handles.clear()

    def names(self) -> list[str]:
        return sorted(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._shapes:
            raise CheckpointError(f"{self.directory}: tensor {name!r} not found")
        return self._shapes[name]

    def read(self, name: str, dim: int | None = None, start: int | None = None,
             stop: int | None = None) -> torch.Tensor:
        """The tensor, or its [start, stop) slice along dim; only those bytes are read."""
        file = self._weight_map.get(name)
        if file is None or name not in self._shapes:
            raise CheckpointError(f"{self.directory}: tensor {name!r} not found")
        path = self.directory / file
        try:
            tensor_slice = self._open(file).get_slice(name)
            if dim is None:
                return tensor_slice[:]
            index = tuple([slice(None)] * dim + [slice(start, stop)])
            return tensor_slice[index]
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} (truncated or corrupt?): {exc}") from None

    def validate(self, expected: dict[str, tuple[int, ...]], ignored: tuple[str, ...] = ()) -> None:
        """Every expected tensor present with its shape; nothing else present."""
        present = set(self._shapes) - set(ignored)
        missing = sorted(set(expected) - present)
        unexpected = sorted(present - set(expected))
        if missing or unexpected:
            raise CheckpointError(f"{self.directory}: tensors do not match the model config: "
                                  f"missing {_short(missing)}; unexpected {_short(unexpected)}")
        wrong = [f"{n}: file {self._shapes[n]} vs config {tuple(expected[n])}" for n in expected
                 if tuple(self._shapes[n]) != tuple(expected[n])]
        if wrong:
            raise CheckpointError(f"{self.directory}: tensor shapes do not match the model config: {_short(wrong)}")
        self._check_sizes()

    def _check_sizes(self) -> None:
        # safe_open reads only the header; a file cut short after it is caught here, before any
        # slice is read (header's last data offset vs file size).
        for file in self.files:
            path = self.directory / file
            with open(path, "rb") as fh:
                header_len = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(header_len))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
            size = path.stat().st_size
            if size < 8 + header_len + end:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, header promises "
                                      f"{8 + header_len + end})")


def _short(items: list[str], limit: int = 20) -> str:
    if not items:
        return "none"
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return "[" + ", ".join(items[:limit]) + "]" + more
