"""The CPU scheduler's classification path: what SGLang 0.5.23 answers at `/classify` for a reward
model (a checkpoint whose architecture SGLang's `is_generation_model` lists as not generating:
Qwen2/Qwen3/Llama/Gemma2 *ForSequenceClassification, *ForRewardModel, ...).

SGLang runs its own model class for the architecture (models/qwen2_classification.py,
qwen3_classification.py, llama_reward.py, ...): its transformer body, then its head over the
hidden state of each request's LAST token (`Pooler(PoolingType.LAST)`, `score_and_pool`). Here:
- the head and the pooling are SGLang's own: its class is constructed with its body class swapped
  for a stand-in (SGLang's __init__ builds the head exactly as on a GPU: Qwen2 / Qwen3's `score` is
  `nn.Linear(hidden, num_labels)` WITH a bias, which HF checkpoints do not have, so it keeps its
  random initialisation, seeded by --random-seed as SGLang seeds before loading; Llama's has none),
  its own `load_weights` loads the head's tensors, and its own `forward` pools and scores;
- the body is HF transformers' (the same weights), whose final hidden states the stand-in hands
  to SGLang's forward, one request after another, concatenated as SGLang's batch layout is.
So /classify's `embedding` is the head's raw output at the last token, [num_labels] floats: HF's
AutoModelForSequenceClassification score (which pools the last non-pad token) plus, for Qwen2 /
Qwen3, that constant random bias, as on a real SGLang server."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch


class _Body(torch.nn.Module):
    """Stands in for SGLang's transformer body class: returns the HF body's hidden states, which
    the scheduler puts on the batch (SGLang's forward passes the batch to its body)."""

    def __init__(self, config, quant_config=None, prefix: str = "", **kwargs):
        super().__init__()

    def forward(self, input_ids, positions, forward_batch, input_embeds=None, **kwargs):
        return forward_batch.hidden_states


@contextlib.contextmanager
def _bodies_replaced(module):
    """SGLang's classification modules name their body class at module level (Qwen2Model,
    Qwen3Model, LlamaModel): each *Model class there is _Body while the head is built."""
    names = [name for name, value in vars(module).items() if isinstance(value, type)
             and issubclass(value, torch.nn.Module) and name.endswith("Model")]
    saved = {name: getattr(module, name) for name in names}
    try:
        for name in names:
            setattr(module, name, _Body)
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


class PoolingBatch:
    """What SGLang's classification forward and `score_and_pool` read of a ForwardBatch."""

    def __init__(self, hidden_states: torch.Tensor, lengths: list[int]):
        self.hidden_states = hidden_states
        self.extend_seq_lens = torch.tensor(lengths)
        self.token_indices_to_pool = None
        self.multi_item_delimiter_indices = None
        self.is_prefill_only = True
        self.return_pooled_hidden_states = False
        self.dimensions = None


class ClassificationModel:
    """SGLang's classification model for the checkpoint (module docstring), on CPU."""

    def __init__(self, model_path: str, model_config, sglang_class: type, random_seed: int):
        from sglang.srt.utils import set_random_seed
        from transformers import AutoModelForSequenceClassification

        dtype = model_config.dtype
        hf = AutoModelForSequenceClassification.from_pretrained(model_path, dtype=dtype).eval()
        self.body = hf.base_model
        set_random_seed(random_seed)  # as SGLang's scheduler does before it builds the model
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # SGLang's set_default_torch_dtype(model_config.dtype)
        try:
            with _bodies_replaced(sys.modules[sglang_class.__module__]):
                self.sglang = sglang_class(config=model_config.hf_config)
        finally:
            torch.set_default_dtype(previous)
        self.sglang.eval()
        self.sglang.load_weights(_head_tensors(model_path))

    @torch.no_grad()
    def embeddings(self, sequences: list[list[int]]) -> torch.Tensor:
        """SGLang's forward over a batch of requests: the pooled head outputs, [batch, num_labels]."""
        hidden = torch.cat([self.body(input_ids=torch.tensor([seq])).last_hidden_state[0] for seq in sequences])
        ids = torch.tensor([t for seq in sequences for t in seq])
        positions = torch.cat([torch.arange(len(seq)) for seq in sequences])
        return self.sglang(ids, positions, PoolingBatch(hidden, [len(seq) for seq in sequences])).embeddings


def _head_tensors(model_path: str):
    """The checkpoint's tensors outside the body ("model.*"): the head, as SGLang's load_weights gets them."""
    from safetensors.torch import load_file

    for file in sorted(Path(model_path).glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            if not name.startswith("model."):
                yield name, tensor
