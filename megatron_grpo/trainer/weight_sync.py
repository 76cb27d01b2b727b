"""After each step: the policy's Megatron shards -> HF-named full tensors -> the rollout engine.

Uses convert/'s streaming export, so the local engine on a CPU run goes through exactly the
resharding that feeds SGLang on a cluster. Every rank must take part (TP gathers, PP sends).
"""
from __future__ import annotations

import torch.distributed as dist

from megatron_grpo.convert.export import gather_hf_weights_on_rank0


def sync_weights(run, version: int) -> None:
    tensors = gather_hf_weights_on_rank0(run.policy, run.model_config, dtype=None)
    if dist.get_rank() == 0:
        run.engine.update_weights(tensors, version)
    # The generator must be exhausted everywhere (it holds collectives), on rank 0 too.
    for _ in tensors:
        pass
