"""Tensor ops: vocab-parallel log-prob / entropy (from logit shards or fused with the output layer),
over the full vocabulary or over each token's sampling support."""
from megatron_grpo.ops.fused_head import (fused_head_logprobs, fused_head_logprobs_and_entropy,
                                          fused_head_support_logprobs, fused_head_support_logprobs_and_entropy)
from megatron_grpo.ops.support_logprobs import (vocab_parallel_support_logprobs,
                                                vocab_parallel_support_logprobs_and_entropy)
from megatron_grpo.ops.vocab_parallel import vocab_parallel_logprobs, vocab_parallel_logprobs_and_entropy

__all__ = ["vocab_parallel_logprobs", "vocab_parallel_logprobs_and_entropy", "fused_head_logprobs",
           "fused_head_logprobs_and_entropy", "vocab_parallel_support_logprobs",
           "vocab_parallel_support_logprobs_and_entropy", "fused_head_support_logprobs",
           "fused_head_support_logprobs_and_entropy"]
