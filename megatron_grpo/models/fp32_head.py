"""The FP32 LM head (model.fp32_lm_head): the output layer's matmul in fp32 even when the model is bf16.

BF16 rounding of the logits is the largest source of engine-vs-trainer log-prob mismatch in RL
(NVIDIA-NeMo/RL #3936); SGLang computes its head in fp32 with --enable-fp32-lm-head, and the
benefit needs both sides. Here the hidden states and the (bf16) weight are upcast for the head
alone (the local rollout engine does the same to its HF model: rollout/local.py); the weight keeps
its dtype, and its gradient reaches it through the cast. In an fp32 model this changes nothing.

Cost: one fp32 copy of this rank's head weight shard (V/tp x H x 4 bytes) and fp32 logits
[tokens, V/tp] during the forward (the bf16 path's logits are upcast by Float16Module anyway), the
matmul at fp32 speed, and under sequence parallelism an fp32 all-gather of the hidden states.
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear


class Fp32OutputLayer(ColumnParallelLinear):
    """megatron's ColumnParallelLinear with its input and weight upcast to fp32 (see above)."""

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        weight = self.weight if weight is None else weight  # tied embeddings pass theirs
        return super().forward(input_.float(), weight=weight.float(), runtime_gather_output=runtime_gather_output)


def use_fp32_output_layer(output_layer: ColumnParallelLinear) -> None:
    """Turns one GPTModel's output layer into an Fp32OutputLayer (same module and state)."""
    output_layer.__class__ = Fp32OutputLayer
    # the fused weight-gradient accumulation writes into the parameter's main_grad, which the
    # fp32 copy of the weight does not have: let autograd route the gradient through the cast
    output_layer.gradient_accumulation_fusion = False

