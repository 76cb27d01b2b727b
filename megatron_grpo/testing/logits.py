"""Full-vocabulary logits of megatron model chunks, for tests that compare them with HF."""
from __future__ import annotations

import torch


def forward_only_logits(chunks: list[torch.nn.Module], tokens: torch.Tensor) -> torch.Tensor | None:
    """One forward-only pass of `tokens` [batch, seq] through megatron's pipeline schedule; on the
    last pipeline stage the logits gathered over tensor parallelism ([batch, seq, padded vocab]),
    elsewhere None."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    batch, seq = tokens.shape
    positions = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    captured = {}

    def step(_, model):
        def loss(output):
            captured["logits"] = output.detach()
            return output.sum() * 0, {}
        return model(tokens, positions, None), loss

    get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]), model=chunks,
                                num_microbatches=1, seq_length=seq, micro_batch_size=batch, forward_only=True)
    if not ps.is_pipeline_last_stage():
        return None
    return gather_from_tensor_model_parallel_region(captured["logits"])
