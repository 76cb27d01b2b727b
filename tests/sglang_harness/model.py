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
The weights are kept unfused and unsharded (SGLang fuses q/k/v and gate/up, and shards by TP);
checksums of `/weights_checker` are therefore over HF names here. MoE experts are the exception:
transformers 5 stores them fused (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I]), and `load_weights` takes the per-expert checkpoint names into them, as SGLang's
FusedMoE expert mapping does (`mlp.experts.{e}.gate_proj / up_proj / down_proj.weight`)."""
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
