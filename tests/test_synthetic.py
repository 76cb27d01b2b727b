"""Synthetic digit tasks: tokenizer folder, deterministic records, and an informative reward
(a random policy scores low, the reference answer 1.0, partial answers in between)."""
from __future__ import annotations

import json
import random

import pytest

from megatron_grpo.data.io import load_records
from megatron_grpo.data.prompts import encode_prompts
from megatron_grpo.data.synthetic import (REWARD_NAME, SyntheticTaskConfig, build_tokenizer, generate_records,
                                          write_dataset)
from megatron_grpo.errors import ConfigError
from megatron_grpo.rewards import RewardRequest, RewardRunner


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("synthetic_tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def _reference(task: str, digits: str) -> str:
    # written independently of data/synthetic.solve
    if task == "reverse":
        return "".join(digits[i] for i in range(len(digits) - 1, -1, -1))
    if task == "copy":
        return digits
    counts = [digits.count(str(d)) for d in range(10)]
    return "".join(str(d) * c for d, c in enumerate(counts))


def test_tokenizer_folder_loads_and_round_trips(tokenizer_dir, tokenizer):
    assert (tokenizer_dir / "tokenizer.json").is_file()
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    text = tokenizer.apply_chat_template([{"role": "user", "content": "reverse 3141"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\nreverse 3141<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    # one token per digit: the answer tokens are copies of prompt tokens
    assert tokenizer.convert_ids_to_tokens(tokenizer("3141", add_special_tokens=False).input_ids) == list("3141")
    assert tokenizer.decode(tokenizer("1413<|im_end|>").input_ids, skip_special_tokens=True) == "1413"
    assert len(tokenizer) < 32


@pytest.mark.parametrize("task", ["reverse", "copy", "sort"])
def test_records_are_deterministic_and_in_verl_layout(tmp_path, task):
    config = SyntheticTaskConfig(task=task, min_digits=3, max_digits=5)
    records = generate_records(config, 200, seed=5)
    assert records == generate_records(config, 200, seed=5)
    assert records != generate_records(config, 200, seed=6)
    lengths = set()
    for record in records:
        digits = record.extra_info["digits"]
        lengths.add(len(digits))
        assert record.prompt == [{"role": "user", "content": f"{task} {digits}"}]
        assert record.ground_truth == _reference(task, digits)
        assert record.data_source == "synthetic/digits"
    assert lengths == {3, 4, 5}
    path = write_dataset(config, tmp_path / "train.jsonl", 50, seed=1)
    assert load_records(path) == generate_records(config, 50, seed=1)


def test_config_validation():
    for bad in [SyntheticTaskConfig(task="add"), SyntheticTaskConfig(min_digits=4, max_digits=3),
                SyntheticTaskConfig(num_symbols=11)]:
        with pytest.raises(ConfigError):
            generate_records(bad, 1, seed=0)


def test_prompts_are_short(tokenizer):
    records = generate_records(SyntheticTaskConfig(), 100, seed=0)
    kept, stats = encode_prompts(records, tokenizer, max_prompt_length=16, overlong="error")
    # 3 (user header) + word + space + 5 digits + 5 (end, assistant header)
    assert stats.kept == 100 and max(len(k.input_ids) for k in kept) == 15


def test_reward_is_informative(tokenizer):
    """No GRPO: score a uniformly random policy, the reference and partly right answers with the
    registered reward, through the runner as the trainer calls it."""
    config = SyntheticTaskConfig()
    records = generate_records(config, 1000, seed=0)
    rng = random.Random(0)
    vocab_size, eos = len(tokenizer), tokenizer.eos_token_id

    def random_response() -> str:
        ids = []
        for _ in range(config.max_digits + 2):
            ids.append(rng.randrange(vocab_size))
            if ids[-1] == eos:
                break
        return tokenizer.decode(ids)

    def partly_right(truth: str) -> str:  # the first half right, the rest wrong
        keep = len(truth) // 2
        return truth[:keep] + "".join(str((int(d) + 1) % 10) for d in truth[keep:])

    with RewardRunner(REWARD_NAME, num_workers=0, timeout_s=None) as runner:
        def mean(responses):
            result = runner.score([RewardRequest("", resp, r.ground_truth, r.extra_info)
                                   for resp, r in zip(responses, records)])
            assert result.metrics["reward/errors"] == 0
            return sum(result.scores) / len(result.scores), result

        random_mean, random_result = mean([random_response() for _ in records])
        reference_mean, reference_result = mean([r.ground_truth + "<|im_end|>" for r in records])
        partial_mean, _ = mean([partly_right(r.ground_truth) for r in records])
    assert reference_mean == 1.0 and reference_result.metrics["reward/exact"] == 1.0
    assert random_mean < 0.1 and random_result.metrics["reward/exact"] < 0.01
    # but not zero: enough random responses earn partial credit for a GRPO group of 8 to differ
    nonzero = sum(s > 0 for s in random_result.scores) / len(records)
    assert nonzero > 0.1 and 1 - (1 - nonzero) ** 8 > 0.5
    assert random_mean < partial_mean < reference_mean
