"""What a scorer's model reads, as token ids of its own tokenizer (both backends score these ids):

- a reward model: the sample's prompt messages plus the response as the assistant's turn, through
  the RM's chat template (its tokenizer's, or reward.models.<name>.chat_template), as its authors
  score conversations (no generation prompt: the conversation is complete);
- a judge: [system,] user = judge.template with {prompt} (the prompt's last user message),
  {response} and {ground_truth} filled in, with the judge's generation prompt.

Token ids rather than text: a template that writes a BOS token would get a second one if the server
tokenized the text again (the Llama-3 templates do)."""
from __future__ import annotations

from typing import Sequence

from megatron_grpo.config.reward_models import JudgeConfig
from megatron_grpo.errors import ConfigError
from megatron_grpo.rewards.runner import RewardRequest


class ChatRenderer:
    def __init__(self, tokenizer, chat_template: str | None, key: str):
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{key}: the tokenizer of {getattr(tokenizer, 'name_or_path', '?')} has no chat "
                              f"template: set {key}.chat_template to a Jinja template string")
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def ids(self, messages: Sequence[dict], generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(list(messages), chat_template=self.chat_template, tokenize=True,
                                                 add_generation_prompt=generation_prompt, return_dict=False)
        return [int(i) for i in ids]


def prompt_messages(request: RewardRequest) -> list[dict]:
    if request.messages is not None:
        return [dict(m) for m in request.messages]
    return [{"role": "user", "content": request.prompt}]


def conversation(request: RewardRequest) -> list[dict]:
    """A reward model's input: the prompt's messages and the response as the assistant's turn."""
    return [*prompt_messages(request), {"role": "assistant", "content": request.response}]


def last_user_text(request: RewardRequest) -> str:
    users = [m["content"] for m in prompt_messages(request) if m.get("role") == "user"]
    return str(users[-1]) if users else request.prompt


def judge_messages(request: RewardRequest, judge: JudgeConfig) -> list[dict]:
    text = judge.template.format(prompt=last_user_text(request), response=request.response,
                                 ground_truth="" if request.ground_truth is None else str(request.ground_truth))
    system = [{"role": "system", "content": judge.system}] if judge.system is not None else []
    return [*system, {"role": "user", "content": text}]


def single_token(tokenizer, text: str, key: str) -> int:
    """The id of `text` when it is one token of the judge's tokenizer (yes_no reads its log-prob)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ConfigError(f"{key}={text!r} is {len(ids)} tokens of the judge's tokenizer ({ids}); yes_no reads "
                          f"one token's log-prob: pick a word that is one token (often with a leading space)")
    return int(ids[0])
