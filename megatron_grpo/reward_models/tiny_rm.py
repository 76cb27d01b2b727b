"""The tiny reward model of recipes/tiny_cpu_rm.yaml: a 2-layer Qwen3 *ForSequenceClassification over
the embedded task's tokenizer, trained with Bradley-Terry pairs (-log sigmoid(r_chosen - r_rejected))
to prefer answers whose first character is the digit 0 (rewards/synthetic.py has_leading_zero) over
answers that do not start with it, for the task's prompts ("reverse 120"). The answers are random
strings of the task's words, symbols and digits, as a random policy writes them. Deterministic for a
seed (one torch thread); 120 Adam steps, seconds on a CPU.

    python -m megatron_grpo.reward_models.tiny_rm outputs/tiny_rm
"""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_grpo.data.synthetic import (SPECIAL_TOKENS, SyntheticTaskConfig, build_tokenizer, generate_records,
                                          vocabulary)
from megatron_grpo.rewards.synthetic import has_leading_zero

TASK = SyntheticTaskConfig("reverse", min_digits=3, max_digits=3, num_symbols=4)  # tiny_cpu's task
MAX_ANSWER = 8  # tiny_cpu's data.max_response_length


@dataclass(frozen=True)
class TinyRewardModel:
    path: Path
    heldout_accuracy: float  # pairs of held-out prompts and answers the model orders right
    margin: float  # mean score of preferred minus other answers there


def train_tiny_reward_model(out: str | Path, seed: int = 0, steps: int = 120, pairs: int = 32) -> TinyRewardModel:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, Qwen3Config

    out = Path(out)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same sums in the same order on any machine
    try:
        torch.manual_seed(seed)
        rng = random.Random(seed)
        build_tokenizer(out)
        tokenizer = AutoTokenizer.from_pretrained(out)
        config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, vocab_size=len(vocabulary()), pad_token_id=0,
                             max_position_embeddings=128, num_labels=1,
                             architectures=["Qwen3ForSequenceClassification"])  # tiny_cpu's policy's shape
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        prompts = generate_records(TASK, 256, seed=seed)
        for _ in range(steps):
            chosen, rejected = _pairs(tokenizer, [rng.choice(prompts) for _ in range(pairs)], rng)
            scores = _scores(model, chosen + rejected)
            loss = -torch.nn.functional.logsigmoid(scores[:pairs] - scores[pairs:]).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():  # prompts and answers it never saw
            held_out = random.Random(seed + 1)
            chosen, rejected = _pairs(tokenizer, generate_records(TASK, 200, seed=seed + 1), held_out)
            scores = _scores(model, chosen + rejected)
        diff = scores[:200] - scores[200:]
        model.save_pretrained(out)
        return TinyRewardModel(out, float((diff > 0).float().mean()), float(diff.mean()))
    finally:
        torch.set_num_threads(threads)


def _pairs(tokenizer, records, rng: random.Random) -> tuple[list[list[int]], list[list[int]]]:
    """Per prompt: an answer with the property and one without, each the rendered conversation's ids."""
    def ids(record, answer: str) -> list[int]:
        return tokenizer.apply_chat_template([*record.prompt, {"role": "assistant", "content": answer}],
                                             tokenize=True, return_dict=False)

    return ([ids(r, _answer(rng, True)) for r in records], [ids(r, _answer(rng, False)) for r in records])


def _answer(rng: random.Random, preferred: bool) -> str:
    pieces = [t for t in vocabulary() if t not in SPECIAL_TOKENS]
    while True:
        answer = "".join(rng.choice(pieces) for _ in range(rng.randint(1, MAX_ANSWER)))
        if preferred:
            answer = "0" + answer[1:] if not answer[0].isalpha() else "0" + answer
        if has_leading_zero(answer) == preferred:
            return answer


def _scores(model, sequences: list[list[int]]) -> torch.Tensor:
    """The score at each sequence's last token (as the scorers pool), right-padded batch."""
    lengths = torch.tensor([len(s) for s in sequences])
    ids = torch.zeros((len(sequences), int(lengths.max())), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, :len(seq)] = torch.tensor(seq)
        mask[row, :len(seq)] = 1
    hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
    return model.score(hidden[torch.arange(len(sequences)), lengths - 1])[:, 0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megatron_grpo.reward_models.tiny_rm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the folder to write (HF model + tokenizer)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rm = train_tiny_reward_model(args.out, seed=args.seed)
    print(f"{rm.path}: held-out pairs ordered right {rm.heldout_accuracy:.3f}, mean margin {rm.margin:.2f}")


if __name__ == "__main__":
    main()
