"""Which of SGLang's parameters an HF tensor of a dense Qwen2 / Qwen3 / Llama model lands in, and how
SGLang splits that parameter over tensor-parallel ranks (its models' `stacked_params_mapping` and the
parallel kind of their layers in srt/layers/linear.py and vocab_parallel_embedding.py). Used to
predict what SGLang's /weights_checker reports (rollout/sglang/expected_checksums.py)."""
from __future__ import annotations

from dataclasses import dataclass

# SGLang's fused parameters: their parts in the order they are concatenated along dim 0
FUSED_PARTS = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}
_STACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
            "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
_ROW_PARALLEL = {"o_proj", "down_proj"}  # RowParallelLinear: the weight's columns over TP
_VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")  # rows over TP, padded
_TIED_HEAD = "lm_head.weight"  # with tied embeddings SGLang's lm_head is embed_tokens


@dataclass(frozen=True)
class SGLangParameter:
    name: str  # SGLang's parameter
    split: str  # "column" (rows over TP), "row" (columns), "vocab" (padded rows), "replicated"
    part: str | None = None  # a FUSED_PARTS part: this tensor's rows within the fused parameter

    @property
    def parts(self) -> tuple[str, ...]:
        """Every part the fused parameter is made of, in order (empty: not fused)."""
        return fused_parts(self.name) if self.part else ()


def fused_parts(sglang_name: str) -> tuple[str, ...]:
    """The parts of a fused SGLang parameter (`...qkv_proj.weight`), in concatenation order."""
    return FUSED_PARTS[sglang_name.rpartition(".")[0].rpartition(".")[2]]


def sglang_parameter(hf_name: str, tied: bool) -> SGLangParameter | None:
    """The SGLang parameter the HF tensor `hf_name` is loaded into; None: none of its own (a tied
    model's lm_head)."""
    if hf_name == _TIED_HEAD and tied:
        return None
    if hf_name in _VOCAB_PARALLEL:
        return SGLangParameter(hf_name, "vocab")
    prefix, _, leaf = hf_name.rpartition(".")  # leaf: weight / bias
    module_path, _, module = prefix.rpartition(".")
    parent = module_path.rpartition(".")[2]
    if module in _STACKED and parent in ("self_attn", "mlp"):
        fused, part = _STACKED[module]
        return SGLangParameter(f"{module_path}.{fused}.{leaf}", "column", part)
    if module in _ROW_PARALLEL and parent in ("self_attn", "mlp") and leaf == "weight":
        return SGLangParameter(hf_name, "row")
    return SGLangParameter(hf_name, "replicated")
