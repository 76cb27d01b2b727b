"""Read and write prompt records as jsonl or parquet (chosen by the file suffix)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from megatron_grpo.data.records import PromptRecord, parse_record
from megatron_grpo.errors import DataError

SUFFIXES = (".jsonl", ".json", ".parquet")


def _format(path: Path) -> str:
    if path.suffix not in SUFFIXES:
        raise DataError(f"{path}: unknown dataset format {path.suffix!r}; expected one of {', '.join(SUFFIXES)}")
    return "parquet" if path.suffix == ".parquet" else "jsonl"


def load_records(path: str | Path) -> list[PromptRecord]:
    """Every record of a jsonl (one JSON object per line, blank lines skipped) or parquet file.
    A bad line raises DataError naming "file:line" (parquet: "file:row N", 1-based)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: dataset file does not exist")
    if _format(path) == "parquet":
        return _load_parquet(path)
    records = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{line_number}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            records.append(parse_record(obj, f"{path}:{line_number}"))
    if not records:
        raise DataError(f"{path}: dataset has no records")
    return records


def _load_parquet(path: Path) -> list[PromptRecord]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise DataError(f"{path}: cannot read parquet: {exc}") from None
    if not rows:
        raise DataError(f"{path}: dataset has no records")
    return [parse_record(row, f"{path}:row {i}") for i, row in enumerate(rows, start=1)]


def write_records(records: Iterable[PromptRecord], path: str | Path) -> Path:
    """Writes records as jsonl or parquet (by suffix); returns the path."""
    path = Path(path)
    rows = [r.to_dict() for r in records]
    path.parent.mkdir(parents=True, exist_ok=True)
    if _format(path) == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        # ground truths and extra_info vary per dataset: stored as they are, arrow infers the schema
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        with path.open("w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path
