"""The recipe's model.lora section against the model it adapts and the features it meets. The adapter folder
it may name (model.lora.adapter_path) is checked before the model is built (trainer/assembly/lora.py)."""
from __future__ import annotations

from megatron_grpo.config.model_dims import model_dims
from megatron_grpo.config.names import LORA_ALL_LINEAR, LORA_TARGET_MODULES
from megatron_grpo.config.schema import Config

LORA_MODEL_TYPES = ("llama", "qwen2", "qwen3")  # dense attention + MLP: lora/targets.py's layers


def lora_problems(c: Config) -> list[str]:
    lora = c.model.lora
    if lora.rank < 0:
        return [f"model.lora.rank={lora.rank}: expected 0 (no LoRA) or a positive integer"]
    if lora.rank == 0:
        return []
    out = []
    if lora.alpha <= 0:
        out.append(f"model.lora.alpha={lora.alpha}: expected a positive number (the scale is alpha / rank)")
    if not 0 <= lora.dropout < 1:
        out.append(f"model.lora.dropout={lora.dropout}: expected a probability in [0, 1)")
    if not lora.target_modules:
        out.append("model.lora.target_modules is empty: name the layers to adapt (or all-linear)")
    unknown = [name for name in lora.target_modules if name not in (*LORA_TARGET_MODULES, LORA_ALL_LINEAR)]
    if unknown:
        out.append(f"model.lora.target_modules: {unknown} are not linear layers of the model; expected names "
                   f"among {list(LORA_TARGET_MODULES)} or {LORA_ALL_LINEAR}")
    model_type = model_dims(c.model).model_type
    if model_type is not None and model_type not in LORA_MODEL_TYPES:
        out.append(f"model.lora with model_type {model_type}: adapters on MoE experts and latent attention are "
                   f"not built yet; LoRA runs {', '.join(LORA_MODEL_TYPES)} models")
    if c.model.attention_backend == "te":
        out.append("model.lora with model.attention_backend=te: adapters sit beside the local layer spec's linear "
                   "layers (Transformer Engine's fuse the norm into them); set torch_varlen (CUDA, bf16) or local")
    if c.ref.model_path is not None:
        out.append("ref.model_path with model.lora: the KL reference of a LoRA run is its base with the adapters "
                   "off (no second copy of the weights); unset ref.model_path")
    if c.ref.param_offload:
        out.append("ref.param_offload with model.lora: the reference is the policy's own base weights, there is "
                   "no separate copy to offload; unset ref.param_offload")
    return out

