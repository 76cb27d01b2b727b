"""The recipe's model.lora section against the model it adapts and the features it meets."""
from __future__ import annotations

from megatron_grpo.config.model_dims import model_dims
from megatron_grpo.config.schema import Config
from megatron_grpo.errors import ConfigError

LORA_MODEL_TYPES = ("llama", "qwen2", "qwen3")  # dense attention + MLP: lora/targets.py's layers


def lora_problems(c: Config) -> list[str]:
    lora = c.model.lora
    if lora.rank < 0:
        return [f"model.lora.rank={lora.rank}: expected 0 (no LoRA) or a positive integer"]
    if lora.rank == 0:
        return []
    from megatron_grpo.lora.targets import TARGET_MODULES, unknown_targets

    out = []
    if lora.alpha <= 0:
        out.append(f"model.lora.alpha={lora.alpha}: expected a positive number (the scale is alpha / rank)")
    if not 0 <= lora.dropout < 1:
        out.append(f"model.lora.dropout={lora.dropout}: expected a probability in [0, 1)")
    if not lora.target_modules:
        out.append("model.lora.target_modules is empty: name the layers to adapt (or all-linear)")
    unknown = unknown_targets(lora.target_modules)
    if unknown:
        out.append(f"model.lora.target_modules: {unknown} are not linear layers of the model; expected names "
                   f"among {list(TARGET_MODULES)} or all-linear")
    model_type = model_dims(c.model).model_type
    if model_type is not None and model_type not in LORA_MODEL_TYPES:
        out.append(f"model.lora with model_type {model_type}: adapters on MoE experts and latent attention are "
                   f"not built yet; LoRA runs {', '.join(LORA_MODEL_TYPES)} models")
    if c.ref.model_path is not None:
        out.append("ref.model_path with model.lora: the KL reference of a LoRA run is its base with the adapters "
                   "off (no second copy of the weights); unset ref.model_path")
    if c.ref.param_offload:
        out.append("ref.param_offload with model.lora: the reference is the policy's own base weights, there is "
                   "no separate copy to offload; unset ref.param_offload")
    if lora.adapter_path is not None and not unknown:
        out.extend(_adapter_folder_problems(c))
    return out


def _adapter_folder_problems(c: Config) -> list[str]:
    from megatron_grpo.lora.peft_folder import ADAPTER_CONFIG, read_adapter_config
    from megatron_grpo.lora.targets import expand_targets

    lora = c.model.lora
    try:
        folder = read_adapter_config(lora.adapter_path)
    except ConfigError as exc:
        return [f"model.lora.adapter_path: {exc}"]
    where = f"model.lora.adapter_path={lora.adapter_path} ({ADAPTER_CONFIG})"
    out = []
    if folder.rank != lora.rank:
        out.append(f"{where}: r={folder.rank} but model.lora.rank={lora.rank}")
    if folder.alpha != lora.alpha:
        out.append(f"{where}: lora_alpha={folder.alpha:g} but model.lora.alpha={lora.alpha:g}")
    if folder.target_modules != expand_targets(lora.target_modules):
        out.append(f"{where}: target_modules {list(folder.target_modules)} but model.lora.target_modules "
                   f"{list(expand_targets(lora.target_modules))}")
    return out
