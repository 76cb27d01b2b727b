"""The model behind the CPU scheduler: an HF `transformers` causal LM with the two methods SGLang's
weight-update code calls on an SGLang model (`load_weights`, `get_weights_by_name`).

Both behave as SGLang 0.5.23's models do where it matters to a trainer:
- `load_weights` copies each named tensor into the parameter of that name with SGLang's own
  `default_weight_loader` (a shape mismatch raises) and SILENTLY SKIPS names it does not know, as
  SGLang's Qwen2/Qwen3/Llama `load_weights` do; only a verification step can catch a mis-named push.
- `get_weights_by_name` returns the first `truncate_size` rows as float lists, as SGLang's Llama
  does, and exists only where SGLang's own model class for the checkpoint's architecture has it
  (`sglang_model_class`: Llama and Mistral do, Qwen2 / Qwen3 / Qwen3-MoE in 0.5.23 do not). Without
  it SGLang's WeightExporter logs the AttributeError and answers None, which the HTTP app turns into
  400 {"error": {"message": "Get parameter by name failed"}}: the harness runs that same code.
The weights are kept unfused and unsharded (every TP rank holds the whole HF model). MoE experts
are the exception: transformers 5 stores them fused (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]), and `load_weights` takes the per-expert checkpoint names into
them, as SGLang's FusedMoE expert mapping does (`mlp.experts.{e}.gate_proj / up_proj /
down_proj.weight`).

`/weights_checker` sees what SGLang's model holds on each TP rank (`SGLangLayout`), for SGLang's
dense Qwen2 / Qwen3 / Llama classes: `qkv_proj` = cat(q, k, v), `gate_up_proj` = cat(gate, up), the
rank's shard of each column / row / vocab-parallel parameter, the vocabulary zero-padded as SGLang
pads it; checked against a real SGLang engine by tests/test_sglang_real_vs_harness.py. Other
architectures (MoE experts, latent attention) are reported under their HF names: a real engine's
differ there."""
from __future__ import annotations

from typing import Iterable

import torch

from tests.sglang_harness.faults import Faults


def load_causal_lm(model_path: str, dtype: torch.dtype, sglang_class: type) -> torch.nn.Module:
    """The HF model, with those of the two methods that SGLang's model class `sglang_class` has."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model.eval()
    _attach_sglang_methods(model, sglang_class)
    return model


def sglang_model_class(model_config) -> type:
    """SGLang's model class for a checkpoint (an SGLang ModelConfig), as its model loader resolves it.

    The class named by the HF config's first architecture in SGLang's module of the config's
    model_type (`sglang.srt.models.qwen3.EntryClass` has `Qwen3ForCausalLM`) is the one SGLang's
    registry maps that architecture to (class names are unique there). Otherwise SGLang's own
    `get_model_architecture` decides; it imports every SGLang model (seconds), so it is the fallback."""
    import importlib

    hf_config = model_config.hf_config
    architectures = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", "")
    if architectures and model_type.isidentifier():
        try:
            module = importlib.import_module(f"sglang.srt.models.{model_type}")
        except ImportError:
            module = None
        entries = getattr(module, "EntryClass", [])
        for cls in entries if isinstance(entries, list) else [entries]:
            if cls.__name__ == architectures[0]:
                return cls
    from sglang.srt.model_loader.utils import get_model_architecture

    return get_model_architecture(model_config)[0]


def _attach_sglang_methods(model: torch.nn.Module, sglang_class: type) -> None:
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    skipped = Faults.from_env().skip_weight  # a fault for tests: this name is "unknown" (faults.py)

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(model.named_parameters(remove_duplicate=False))
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                target = resolve_param(params, name) if name != skipped else None
                if target is not None:
                    default_weight_loader(target, tensor)
                    loaded.add(name)
        return loaded

    def get_weights_by_name(name: str, truncate_size: int = 100, tp_size: int = 1):
        params = dict(model.named_parameters(remove_duplicate=False))
        if name not in params:
            return None
        return params[name].detach().cpu().to(torch.float32).numpy().tolist()[:truncate_size]

    model.load_weights = load_weights
    if hasattr(sglang_class, "get_weights_by_name"):
        model.get_weights_by_name = get_weights_by_name


def resolve_param(params: dict[str, torch.nn.Parameter], name: str) -> torch.Tensor | None:
    """The parameter (or the view of a fused expert parameter) that the checkpoint tensor `name`
    fills, or None for a name the model does not know (`...mlp.experts.{e}.gate_proj.weight` ->
    gate_up_proj[e, :I])."""
    if name in params:
        return params[name]
    prefix, sep, rest = name.partition(".mlp.experts.")
    parts = rest.split(".")
    if not sep or len(parts) != 3 or not parts[0].isdigit() or parts[2] != "weight":
        return None
    expert, projection = int(parts[0]), parts[1]
    fused = f"{prefix}.mlp.experts.{'down_proj' if projection == 'down_proj' else 'gate_up_proj'}"
    if fused not in params or projection not in ("gate_proj", "up_proj", "down_proj"):
        return None
    param = params[fused].data[expert]
    if projection == "down_proj":
        return param
    half = param.shape[0] // 2
    return param[:half] if projection == "gate_proj" else param[half:]


# SGLang's model classes whose parameters SGLangLayout reproduces (srt/models/qwen2.py, qwen3.py,
# llama.py: QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding).
DENSE_FUSED_CLASSES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")
VOCAB_PADDING = 64  # SGLang's DEFAULT_VOCAB_PADDING_SIZE


class SGLangLayout:
    """The parameters SGLang's dense model holds on TP rank `tp_rank` of `tp_size`, computed from the
    HF model at each call, for SGLang's WeightChecker (named_parameters / named_buffers /
    named_modules are all it reads). Read-only: the checker's reset_tensors goes to the HF model."""

    def __init__(self, model: torch.nn.Module, hf_config, tp_rank: int, tp_size: int):
        self.model, self.tp_rank, self.tp_size = model, tp_rank, tp_size
        self.num_kv_heads = hf_config.num_key_value_heads
        self.head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads

    def named_parameters(self):
        params = dict(self.model.named_parameters())  # a tied lm_head is embed_tokens: once, as in SGLang
        fused: dict[str, dict[str, torch.Tensor]] = {}
        for name, param in params.items():
            prefix, _, leaf = name.rpartition(".")
            module_path, _, module = prefix.rpartition(".")
            target = next((f for f, parts in FUSED.items() if module in parts), None)
            if target is not None:
                fused.setdefault(f"{module_path}.{target}.{leaf}", {})[module] = self._column(module, param.detach())
                continue
            yield name, self._shard(name, module, param.detach())
        for name, parts in fused.items():
            order = FUSED[name.rsplit(".", 2)[1]]
            yield name, torch.cat([parts[part] for part in order])

    def named_buffers(self):
        return self.model.named_buffers()  # rotary tables: SGLang's checker skips them

    def named_modules(self):
        return iter(())  # no quantized modules

    def _column(self, module: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a column-parallel part; K/V heads replicated when there are fewer
        of them than ranks (each on tp_size / num_kv_heads ranks), as QKVParallelLinear does."""
        if module in ("k_proj", "v_proj") and self.tp_size > self.num_kv_heads:
            head = self.tp_rank // (self.tp_size // self.num_kv_heads)
            return tensor[head * self.head_dim:(head + 1) * self.head_dim]
        return tensor.chunk(self.tp_size)[self.tp_rank]

    def _shard(self, name: str, module: str, tensor: torch.Tensor) -> torch.Tensor:
        if module in ROW_PARALLEL and name.endswith(".weight"):
            return tensor.chunk(self.tp_size, dim=1)[self.tp_rank]
        if name in VOCAB_PARALLEL:
            pad = VOCAB_PADDING if _round_up(tensor.shape[0], VOCAB_PADDING) % self.tp_size == 0 \
                else VOCAB_PADDING * self.tp_size
            padded = tensor.new_zeros((_round_up(tensor.shape[0], pad), *tensor.shape[1:]))
            padded[:tensor.shape[0]] = tensor
            return padded.chunk(self.tp_size)[self.tp_rank]
        return tensor


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple
