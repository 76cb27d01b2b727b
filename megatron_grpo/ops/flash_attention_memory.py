"""The memory a GPU's fused attention uses, as a core-attention module for the planner's models.

On a GPU the trainer runs Transformer Engine's fused (flash) attention: forward keeps Q, K, V,
the output and the fp32 log-sum-exp per query and head for backward; backward allocates dQ, dK,
dV and an fp32 dQ accumulator. The CPU's local kernel (ops/varlen_attention.py) materialises
[heads, L, L] fp32 scores instead, which no GPU run holds, so the planner builds its models with
this module (builder backend "memory-model"). Under context parallelism TE's ring attention keeps
two K/V chunks in flight (send and receive buffers); they are saved here as well. Multi-head latent
attention (DeepSeek-V3) has a value head (v_channels) narrower than its q/k head (k_channels: nope +
rope dims): the output and its gradient take the value's width, as FlashAttention-3's / TE's kernels
with hdim_v != hdim_qk return it. Values are not computed: the planner runs on fake tensors.
"""
from __future__ import annotations

import torch



def _module_base():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class _FlashAttentionMemory(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, ring_buffers: int):
        # query [t, h, d]; key [t, g, d]; value [t, g, d_v] (MLA: d_v != d)
        out = query.new_empty(*query.shape[:-1], value.size(-1))
        lse = torch.empty(query.size(1), query.size(0), dtype=torch.float32, device=query.device)
        ring = [torch.empty_like(key) for _ in range(2 * ring_buffers)]
        ctx.save_for_backward(query, key, value, out, lse, *ring)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value = ctx.saved_tensors[:3]
        accumulator = torch.empty(query.shape, dtype=torch.float32, device=query.device)  # dq_accum
        grad_query = torch.empty_like(query)
        del accumulator
        return grad_query, torch.empty_like(key), torch.empty_like(value), None


class FlashAttentionMemoryModel(_module_base()):
    """megatron's core-attention interface (constructor and forward), a fused kernel's memory;
    padded and packed inputs, any context-parallel size."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, k_channels: int | None = None,
                 v_channels: int | None = None):
        super().__init__(config=config)
        from megatron.core import parallel_state as ps

        tp_size = ps.get_tensor_model_parallel_world_size()
        # the output width: heads x the value head (MLA's v_channels; kv_channels otherwise)
        self.hidden_size_per_partition = (v_channels or config.kv_channels) * config.num_attention_heads // tp_size
        self.ring_buffers = 1 if config.context_parallel_size > 1 else 0

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        # padded batches arrive [s, b, h, d]; packed ones [t, h, d] (megatron squeezed b = 1)
        shape = query.shape
        q, k, v = (x.reshape(-1, x.size(-2), x.size(-1)) for x in (query, key, value))
        context = _FlashAttentionMemory.apply(q, k, v, self.ring_buffers)
        return context.reshape(*shape[:-2], self.hidden_size_per_partition)
