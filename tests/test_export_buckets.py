"""The export moves buckets, not tensors (convert/export.py): the same tiny model loaded at TP=2 and
at PP=2 (2 gloo ranks) exports the same HF tensors, bit for bit, whatever the bucket size, and the
collectives it runs are counted: with buckets larger than the model, one tensor-parallel all_gather
per dtype and one send (plus one pickled bucket list) per pipeline stage; with one-tensor buckets,
one per tensor. A model with 4x the tensors at about the same bytes (4x the layers, half the width)
runs the same number with large buckets (trainer/sync's routes read these generators)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from megatron_grpo.testing.distributed import run_distributed

COUNTED = ("all_gather", "send", "recv", "send_object_list", "recv_object_list", "broadcast",
           "broadcast_object_list")
HUGE, TINY = 2**40, 1


def _export(rank, world_size, folder, layout, bucket_bytes):
    import torch.distributed as dist

    from megatron_grpo.convert import load_hf_weights
    from megatron_grpo.convert.export import gather_hf_weights_on_rank0
    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import ModelArchitecture, build_model

    parallel = ParallelLayout(**layout)
    initialize_model_parallel(parallel, seed=1)
    arch = ModelArchitecture.from_hf(folder, tensor_parallel=parallel.tensor, vocab_multiple=8)
    chunks = build_model(arch, parallel)
    load_hf_weights(chunks, arch, folder)
    calls, originals = Counter(), {name: getattr(dist, name) for name in COUNTED}

    def counted(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)
        return call

    for name in COUNTED:
        setattr(dist, name, counted(name))
    try:
        tensors = {name: tensor.clone() for name, tensor in gather_hf_weights_on_rank0(chunks, arch,
                                                                                         bucket_bytes=bucket_bytes)}
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return tensors, dict(calls)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megatron_grpo.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp("export_buckets")
    save_tiny_hf_model("qwen3", root / "narrow", seed=0, num_hidden_layers=8, hidden_size=32, intermediate_size=64)
    save_tiny_hf_model("qwen3", root / "wide", seed=0, num_hidden_layers=2, hidden_size=64, intermediate_size=128)
    return {name: str(root / name) for name in ("wide", "narrow")}


@pytest.mark.parametrize("layout", [{"tensor": 2}, {"pipeline": 2}], ids=["tp2", "pp2"])
def test_export_moves_buckets_and_yields_the_same_tensors(models, layout):
    results = {(name, size): run_distributed(_export, 2, (folder, layout, size), timeout=300)
               for name, folder in models.items() for size in (HUGE, TINY)}
    for (name, size), ranks in results.items():  # the figures of docs/training.md (pytest -s)
        print(f"export {layout} {name}: {len(ranks[0][0])} tensors, "
              f"{'one-tensor' if size == TINY else 'large'} buckets: {[calls for _, calls in ranks]}")
    for name in models:
        (big, big_calls), _ = results[(name, HUGE)]
        (small, small_calls), _ = results[(name, TINY)]
        assert list(big) == list(small) and all(torch.equal(big[k], small[k]) for k in big), name
    wide_calls = {rank: results[("wide", HUGE)][rank][1] for rank in (0, 1)}
    narrow_calls = {rank: results[("narrow", HUGE)][rank][1] for rank in (0, 1)}
    assert wide_calls == narrow_calls, (wide_calls, narrow_calls)
    if layout == {"tensor": 2}:
        assert wide_calls[0]["all_gather"] == 1 and not {"send", "recv"} & set(wide_calls[0])
        # one-tensor buckets: one gather per TP-split tensor, 4x the layers' worth
        assert results[("narrow", TINY)][0][1]["all_gather"] > 2 * results[("wide", TINY)][0][1]["all_gather"]
    else:  # stage 1 sends one bucket (metadata + flat tensor) and the end marker to rank 0
        assert wide_calls[1] == {"send_object_list": 2, "send": 1}
        assert wide_calls[0] == {"recv_object_list": 2, "recv": 1}
        assert results[("narrow", TINY)][1][1]["send"] > 2 * results[("wide", TINY)][1][1]["send"]
