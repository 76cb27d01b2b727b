"""ops/context_parallel.py: CP=2 (and CP=2 x TP=2) logits and gradients equal CP=1, and the
split / gather helpers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_grpo.models.tiny import save_tiny_hf_model
from megatron_grpo.testing.distributed import run_distributed

SEQ, BATCH = 32, 2


def test_local_positions_layout():
    from megatron_grpo.ops.context_parallel import local_positions, split_for_context_parallel

    # 2*CP = 4 chunks of 4: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert local_positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    x = torch.arange(32).view(2, 16)
    parts = [split_for_context_parallel(x, 1, r, 2) for r in range(2)]
    assert sorted(torch.cat(parts, 1)[0].tolist()) == list(range(16))


def _run(rank, world_size, path, tp, cp):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_grpo.convert import export_hf_weights, load_hf_weights
    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import ModelArchitecture, build_model
    from megatron_grpo.ops.context_parallel import gather_from_context_parallel, split_for_context_parallel

    layout = ParallelLayout(tensor=tp, context=cp)
    initialize_model_parallel(layout)
    cfg = ModelArchitecture.from_hf(path, tensor_parallel=tp, vocab_multiple=8)
    chunks = build_model(cfg, layout)
    load_hf_weights(chunks, cfg, path)
    model = chunks[0]
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    weights = torch.randn(BATCH, SEQ, cfg.padded_vocab_size, generator=g)
    local_tokens = split_for_context_parallel(tokens)
    positions = split_for_context_parallel(torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1))
    logits = model(local_tokens, positions, None)                 # [b, s/cp, v/tp]
    full = gather_from_context_parallel(gather_from_tensor_model_parallel_region(logits))
    # A loss that touches every logit; each CP rank contributes its own tokens' part.
    local_w = split_for_context_parallel(weights)
    tp_rank = ps.get_tensor_model_parallel_rank()
    v = logits.size(-1)
    loss = (logits * local_w[..., tp_rank * v:(tp_rank + 1) * v]).sum()
    loss.backward()
    cp_group = ps.get_context_parallel_group()
    tp_group = ps.get_tensor_model_parallel_group()
    for name, p in model.named_parameters():  # what megatron DDP + finalize_model_grads do:
        torch.distributed.all_reduce(p.grad, group=cp_group)  # sum over the DP x CP group
        if "q_layernorm" in name or "k_layernorm" in name:  # per-head norms see only local heads
            torch.distributed.all_reduce(p.grad, group=tp_group)
        p.data.copy_(p.grad)  # export the gradients through the HF mapping, as full tensors
    grads = {name: t.numpy() for name, t in export_hf_weights(chunks, cfg)}
    return full.detach().numpy(), grads


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return str(save_tiny_hf_model("qwen3", tmp_path_factory.mktemp("cp") / "qwen3", seed=5))


@pytest.mark.slow
def test_cp_matches_cp1(qwen3):
    ref_logits, ref_grads = run_distributed(_run, 1, args=(qwen3, 1, 1), timeout=300)[0]
    for tp, cp in ((1, 2), (2, 2)):
        results = run_distributed(_run, tp * cp, args=(qwen3, tp, cp), timeout=300)
        for logits, grads in results:
            rel = np.abs(logits - ref_logits).max() / np.abs(ref_logits).max()
            assert rel <= 1e-5, f"TP={tp} CP={cp}: logits relative error {rel:.2e}"
            assert sorted(grads) == sorted(ref_grads)
            for name, ref in ref_grads.items():
                err = np.abs(grads[name] - ref).max() / max(np.abs(ref).max(), 1e-12)
                assert err <= 1e-5, f"TP={tp} CP={cp}: grad of {name} relative error {err:.2e}"
