"""Synthetic digit tasks for the embedded default: a tiny tokenizer and prompt records (verl layout).

Task "reverse" (default), "copy" or "sort": the prompt is e.g. "reverse 314" and the reference
answer "413" (one token per digit). The answer digits are copies of prompt digits, so a randomly
initialised tiny model can learn the task from rewards alone; the reward ("synthetic" in rewards/)
gives credit per position.
The tokenizer has one token per digit, word and special token; it round-trips the text exactly.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from megatron_grpo.data.io import write_records
from megatron_grpo.data.records import PromptRecord
from megatron_grpo.errors import ConfigError

TASKS = ("reverse", "copy", "sort")
DATA_SOURCE = "synthetic/digits"
REWARD_NAME = "synthetic"  # the rewards/ registry name of this task's reward

PAD_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (PAD_TOKEN, "<|im_start|>", "<|im_end|>", "<unk>")
WORDS = ("system", "user", "assistant", *TASKS)
SYMBOLS = ("\n", " ", ":", ".")
DIGITS = tuple("0123456789")
# Qwen-style chat markup, so the tiny runs exercise the same formatting path as real models
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class SyntheticTaskConfig:
    task: str = "reverse"
    min_digits: int = 3
    max_digits: int = 5
    # digits are drawn from 0..num_symbols-1. Measured with a random-init Qwen3 (hidden 64, 2 layers),
    # 16 prompts x 8 samples, Adam 1e-3, one on-policy update per step: reverse with 5 symbols went
    # from reward 0.06 to 0.25 in 100 steps; with 10 symbols it was still at 0.09 after 110 steps.
    num_symbols: int = 5

    def validate(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"synthetic task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if not 1 <= self.min_digits <= self.max_digits:
            raise ConfigError(f"synthetic digits: need 1 <= min_digits <= max_digits, got "
                              f"{self.min_digits}..{self.max_digits}")
        if not 2 <= self.num_symbols <= 10:
            raise ConfigError(f"synthetic num_symbols must be in 2..10, got {self.num_symbols}")


def vocabulary() -> list[str]:
    return [*SPECIAL_TOKENS, *WORDS, *SYMBOLS, *DIGITS]


def solve(task: str, digits: str) -> str:
    """The reference answer: an independent restatement of each task."""
    if task == "reverse":
        return digits[::-1]
    if task == "copy":
        return digits
    if task == "sort":
        return "".join(sorted(digits))
    raise ConfigError(f"synthetic task must be one of {', '.join(TASKS)}, got {task!r}")


def generate_records(config: SyntheticTaskConfig, count: int, seed: int, split: str = "train") -> list[PromptRecord]:
    """`count` prompt records, the same for the same (config, count, seed)."""
    config.validate()
    rng = random.Random(f"synthetic:{seed}")
    records = []
    for index in range(count):
        length = rng.randint(config.min_digits, config.max_digits)
        digits = "".join(str(rng.randrange(config.num_symbols)) for _ in range(length))
        records.append(PromptRecord(
            data_source=DATA_SOURCE,
            prompt=[{"role": "user", "content": f"{config.task} {digits}"}],
            ground_truth=solve(config.task, digits),
            ability="synthetic",
            reward_style="rule",
            extra_info={"split": split, "index": index, "task": config.task, "digits": digits},
        ))
    return records


def write_dataset(config: SyntheticTaskConfig, path: str | Path, count: int, seed: int,
                  split: str = "train") -> Path:
    """Generates records and writes them as jsonl or parquet (by suffix)."""
    return write_records(generate_records(config, count, seed, split), path)


def build_tokenizer(folder: str | Path, model_max_length: int = 256) -> Path:
    """Writes an HF tokenizer folder (tokenizer.json, tokenizer_config.json, chat template) for the
    synthetic tasks, loadable with transformers.AutoTokenizer.from_pretrained(folder)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(vocabulary())}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # every word, digit and single character is its own piece; nothing is dropped, so decode
    # (Fuse: concatenate) gives back the exact text
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[A-Za-z]+|[^A-Za-z]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token=PAD_TOKEN, unk_token="<unk>",
        model_max_length=model_max_length, padding_side="left", clean_up_tokenization_spaces=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    # transformers 5 writes the template to chat_template.jinja; older versions read tokenizer_config.json
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return folder
