#!/usr/bin/env python
"""Convert the original GSM8K jsonl (question, answer) into prompt records (verl layout).

    python tools/prepare_gsm8k.py --input data/gsm8k/train.jsonl --output data/gsm8k_rl/train.parquet

Each record's prompt is the question followed by verl's instruction ("Let's think step by step and
output the final answer after \"####\"."); the ground truth is the number after "####" in the
reference answer, with thousands separators removed. data_source is "openai/gsm8k", as in verl, so
rewards and metrics can be compared.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from tqdm import tqdm

from megatron_grpo.data.io import write_records
from megatron_grpo.data.records import PromptRecord
from megatron_grpo.errors import DataError, MegatronGRPOError

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
DATA_SOURCE = "openai/gsm8k"
_FINAL = re.compile(r"#### (\-?[0-9\.\,]+)")


def reference_answer(answer: str, where: str) -> str:
    match = _FINAL.search(answer)
    if match is None:
        raise DataError(f"{where}: the answer has no '#### <number>' line")
    return match.group(1).replace(",", "")


def convert_line(obj: object, split: str, index: int, where: str) -> PromptRecord:
    if not isinstance(obj, dict) or not isinstance(obj.get("question"), str) or not isinstance(obj.get("answer"), str):
        raise DataError(f"{where}: expected an object with string fields 'question' and 'answer'")
    question, answer = obj["question"], obj["answer"]
    return PromptRecord(
        data_source=DATA_SOURCE,
        prompt=[{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        ground_truth=reference_answer(answer, where),
        ability="math",
        reward_style="rule",
        extra_info={"split": split, "index": index, "question": question, "answer": answer},
    )


def convert_file(source: Path, output: Path, split: str, limit: int | None = None,
                 progress: bool = True) -> int:
    """Converts `source` into `output` (.jsonl or .parquet); returns the number of records."""
    if not source.is_file():
        raise DataError(f"{source}: file does not exist")
    lines = source.read_text(encoding="utf-8").splitlines()
    records = []
    for line_number, line in enumerate(tqdm(lines, desc=f"gsm8k {split}", unit="q", disable=not progress), 1):
        if not line.strip():
            continue
        where = f"{source}:{line_number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: invalid JSON ({exc.msg})") from None
        records.append(convert_line(obj, split, len(records), where))
        if limit is not None and len(records) >= limit:
            break
    write_records(records, output)
    return len(records)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--input", type=Path, required=True, help="original GSM8K jsonl (question, answer)")
    parser.add_argument("--output", type=Path, required=True, help="output file: .jsonl or .parquet")
    parser.add_argument("--split", default=None, help="split name stored in extra_info (default: input file stem)")
    parser.add_argument("--limit", type=int, default=None, help="convert only the first N questions")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        count = convert_file(args.input, args.output, args.split or args.input.stem, args.limit,
                             progress=not args.no_progress)
    except MegatronGRPOError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"wrote {count} records to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
