"""Read and write prompt records as jsonl or parquet (chosen by the file suffix)."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Iterable

from megatron_grpo.data.records import PromptRecord, RecordFormat, parse_record, scalar_answer
from megatron_grpo.errors import DataError

SUFFIXES = (".jsonl", ".json", ".parquet")


def _format(path: Path) -> str:
    if path.suffix not in SUFFIXES:
        raise DataError(f"{path}: unknown dataset format {path.suffix!r}; expected one of {', '.join(SUFFIXES)}")
    return "parquet" if path.suffix == ".parquet" else "jsonl"


def load_records(path: str | Path, fmt: RecordFormat = RecordFormat()) -> list[PromptRecord]:
    """Every record of a jsonl (one JSON object per line, blank lines skipped) or parquet file,
    read by `fmt`. A bad line raises DataError naming "file:line" (parquet: "file:row N", 1-based)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: dataset file does not exist")
    if _format(path) == "parquet":
        records = _load_parquet(path, fmt)
    else:
        records = [_record(line, f"{path}:{number}", fmt)
                   for number, line in enumerate(_utf8_lines(path), start=1) if line.strip()]
    if not records:
        raise DataError(f"{path}: dataset has no records")
    return records


def _utf8_lines(path: Path) -> Iterable[str]:
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}:{number}: not UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} "
                                "of the line); JSON Lines files are UTF-8: re-encode the file "
                                "(e.g. iconv -f latin1 -t utf-8)") from None


def _record(line: str, where: str, fmt: RecordFormat) -> PromptRecord:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    return _checked(parse_record(obj, where, fmt), where, fmt)


def _checked(record: PromptRecord, where: str, fmt: RecordFormat) -> PromptRecord:
    """With a one-answer scorer: the ground truth normalised (records.scalar_answer), or DataError
    when that scorer could never score a response correct against it."""
    answer, scorer = record.ground_truth, fmt.scalar_ground_truth_for
    if not scorer:
        return record
    shown = f"{json.dumps(answer)[:60]} ({type(answer).__name__})"
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DataError(f"{where}: reward_model.ground_truth is {shown}; the {scorer} scorer compares one answer, "
                        "a string or number: write the answer itself, or set reward.function to a function "
                        "of yours that reads this form")
    answer = scalar_answer(answer)
    if answer == "":
        problem = "it is empty or whitespace only"
    elif isinstance(answer, float) and math.isnan(answer):
        problem = "it is NaN: a float column's missing value"
    else:
        problem = fmt.ground_truth_problem(record.data_source, answer) if fmt.ground_truth_problem else None
    if problem:
        raise DataError(f"{where}: reward_model.ground_truth is {shown}: the {scorer} scorer can never score a "
                        f"response correct against it ({problem}); fix the answer, or set reward.function to a "
                        "function of yours")
    return record if answer == record.ground_truth else dataclasses.replace(record, ground_truth=answer)


def _load_parquet(path: Path, fmt: RecordFormat) -> list[PromptRecord]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise DataError(f"{path}: cannot read parquet: {exc}") from None
    return [_checked(parse_record(row, f"{path}:row {i}", fmt), f"{path}:row {i}", fmt)
            for i, row in enumerate(rows, start=1)]


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
