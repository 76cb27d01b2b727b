"""pass@k on the validation prompts, and `megatron-grpo eval`."""
