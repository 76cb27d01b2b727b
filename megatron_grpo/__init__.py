"""megatron-grpo: GRPO for large language models on megatron-core, with SGLang rollouts."""

__version__ = "0.1.0"
