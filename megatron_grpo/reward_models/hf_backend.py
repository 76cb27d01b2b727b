"""HFBackend: a scorer's model in this process with transformers (backend=hf): tiny models on CPU,
small ones on one GPU. Reward models score as SGLang's classification models do: the model's
`score` head on the final hidden state of each sequence's last token (HF's own pooling picks the
last token that is not the pad id instead, which differs only for a sequence ending in that id).
Judges answer greedily; the yes / no log-probs are log_softmax of the unscaled logits, as SGLang
returns them for greedy requests."""
from __future__ import annotations

import threading
from typing import Sequence

import torch

from megatron_grpo.config.scorer_checkpoint import load_report_problem
from megatron_grpo.errors import ConfigError
from megatron_grpo.reward_models.backend import JudgeReply

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class HFBackend:
    concurrency = 1  # one forward at a time: the trainer's process has the cores it has

    def __init__(self, path: str, kind: str, device: str, dtype: str, key: str, tokenizer=None):
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        if device == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"{key}.device=cuda but CUDA is not available here")
        loader = AutoModelForSequenceClassification if kind == "reward_model" else AutoModelForCausalLM
        model, info = loader.from_pretrained(path, dtype=DTYPES[dtype], output_loading_info=True)
        # a hub id's folder was not local for the recipe check (config/scorer_checkpoint.py): the load's report
        problem = load_report_problem(key, path, kind, info["missing_keys"], info["unexpected_keys"])
        if problem:
            raise ConfigError(problem)
        self.model = model.to(device).eval()
        if kind == "reward_model" and not isinstance(getattr(self.model, "score", None), torch.nn.Module):
            raise ConfigError(f"{key}: {type(self.model).__name__} has no `score` head; the in-process backend serves "
                              f"the Llama / Qwen2 / Qwen3 / Mistral / Gemma *ForSequenceClassification layout")
        self.device = torch.device(device)
        self.tokenizer = tokenizer  # judges: decodes answers
        self.pad_id = 0  # any id: padded positions are masked and never read
        self.where = f"in-process ({device})"
        self._lock = threading.Lock()  # an abandoned (timed-out) call may still run beside the next

    @torch.no_grad()
    def classify(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        ids, mask, lengths = self._right_padded(sequences)
        with self._lock:
            hidden = self.model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = hidden[torch.arange(len(lengths), device=self.device), lengths - 1]
            scores = self.model.score(last)
        return [float(s) for s in scores[:, 0].float().cpu()]

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 logprob_token_ids: Sequence[int] | None = None) -> list[JudgeReply]:
        ids, mask, lengths = self._right_padded(prompts)
        with self._lock:
            logits = self.model(input_ids=ids, attention_mask=mask).logits
            first = torch.log_softmax(logits[torch.arange(len(lengths), device=self.device), lengths - 1].float(), -1)
            answers = [[int(t)] for t in first.argmax(-1).cpu()]
            for row, prompt in enumerate(prompts):  # greedy, one sequence at a time: no padding to get wrong
                if max_new_tokens > 1 and answers[row][0] not in self._stop_ids():
                    out = self.model.generate(torch.tensor([list(prompt)], device=self.device), do_sample=False,
                                              max_new_tokens=max_new_tokens, pad_token_id=self._pad_for_generate())
                    answers[row] = [int(t) for t in out[0, len(prompt):].cpu()]
        replies = []
        for row, answer in enumerate(answers):
            logprobs = ({int(t): float(first[row, int(t)]) for t in logprob_token_ids}
                        if logprob_token_ids is not None else None)
            replies.append(JudgeReply(self.tokenizer.decode(answer, skip_special_tokens=True), logprobs))
        return replies

    def _right_padded(self, sequences: Sequence[Sequence[int]]):
        if not sequences or any(len(s) == 0 for s in sequences):
            raise ValueError("empty input sequence")
        lengths = torch.tensor([len(s) for s in sequences], device=self.device)
        width = int(lengths.max())
        ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, :len(seq)] = torch.tensor(list(seq))
            mask[row, :len(seq)] = 1
        return ids.to(self.device), mask.to(self.device), lengths

    def _stop_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        return set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    def _pad_for_generate(self) -> int:
        pad = self.model.generation_config.pad_token_id
        return pad if pad is not None else min(self._stop_ids() or {0})

    def close(self) -> None:
        self.model = None
