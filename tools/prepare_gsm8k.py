#!/usr/bin/env python
"""Convert the original GSM8K jsonl (question, answer) into prompt records (verl layout).

    python tools/prepare_gsm8k.py --input data/gsm8k/train.jsonl --output data/gsm8k_rl/train.parquet
    python tools/prepare_gsm8k.py ... --tokenizer Qwen/Qwen3-8B   # + token lengths, for max_*_length

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


def length_report(output: Path, tokenizer_path: str) -> str:
    """Token lengths of the written prompts, as the trainer formats them (the tokenizer's chat
    template), and of the reference answers: what data.max_prompt_length / max_response_length
    must hold. `qwen`: Qwen's tokenizer built offline (scripts/install_qwen_vocab.sh)."""
    from megatron_grpo.data.io import load_records
    from megatron_grpo.data.prompts import render_chat
    from megatron_grpo.trainer.assembly.tokenizer import load_tokenizer

    if tokenizer_path == "qwen":
        from megatron_grpo.testing.qwen_tokenizer import build_qwen_tokenizer

        tokenizer_path = str(build_qwen_tokenizer())
    tokenizer = load_tokenizer(tokenizer_path, f"--tokenizer {tokenizer_path}")
    records = load_records(output)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    templated = bool(tokenizer.chat_template)
    prompts = sorted(count(render_chat(r.prompt, tokenizer, None) if templated else r.prompt[-1]["content"])
                     for r in records)
    answers = sorted(count(r.extra_info["answer"]) for r in records)
    formatted = "as the trainer formats them" if templated else "(the tokenizer has no chat template: the text only)"

    def summary(lengths: list[int]) -> str:
        return (f"median {lengths[len(lengths) // 2]}, p99 {lengths[min(len(lengths) - 1, len(lengths) * 99 // 100)]}"
                f", max {lengths[-1]}")

    return (f"tokens ({tokenizer_path}): prompts {formatted} {summary(prompts)}; "
            f"reference answers {summary(answers)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--input", type=Path, required=True, help="original GSM8K jsonl (question, answer)")
    parser.add_argument("--output", type=Path, required=True, help="output file: .jsonl or .parquet")
    parser.add_argument("--split", default=None, help="split name stored in extra_info (default: input file stem)")
    parser.add_argument("--limit", type=int, default=None, help="convert only the first N questions")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--tokenizer", default=None,
                        help="also report token lengths with this HF tokenizer (a folder or hub id; 'qwen': Qwen's, "
                             "built offline)")
    args = parser.parse_args(argv)
    try:
        count = convert_file(args.input, args.output, args.split or args.input.stem, args.limit,
                             progress=not args.no_progress)
        print(f"wrote {count} records to {args.output}")
        if args.tokenizer:
            print(length_report(args.output, args.tokenizer))
    except MegatronGRPOError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
