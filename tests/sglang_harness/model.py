"""The model behind the CPU scheduler: an HF `transformers` causal LM with the two methods SGLang's
weight-update code calls on an SGLang model (`load_weights`, `get_weights_by_name`).

Both behave as SGLang 0.5.23's models do where it matters to a trainer:
- `load_weights` copies each named tensor into the parameter of that name with SGLang's own
  `default_weight_loader` (a shape mismatch raises) and SILENTLY SKIPS names it does not know, as
  SGLang's Qwen2/Qwen3/Llama `load_weights` do; only a verification step can catch a mis-named push.
- `get_weights_by_name` returns the first `truncate_size` rows as float lists, as SGLang's Llama
  does (Qwen2/Qwen3 have no such method in 0.5.23; the harness answers for every model so that
  value checks can be tested).
The weights are kept unfused and unsharded (SGLang fuses q/k/v and gate/up, and shards by TP);
checksums of `/weights_checker` are therefore over HF names here. MoE experts are the exception:
transformers 5 stores them fused (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I]), and `load_weights` takes the per-expert checkpoint names into them, as SGLang's
FusedMoE expert mapping does (`mlp.experts.{e}.gate_proj / up_proj / down_proj.weight`)."""
from __future__ import annotations

from typing import Iterable

import torch


def load_causal_lm(model_path: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model.eval()
    _attach_sglang_methods(model)
    return model


def _attach_sglang_methods(model: torch.nn.Module) -> None:
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(model.named_parameters(remove_duplicate=False))
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                target = resolve_param(params, name)
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
