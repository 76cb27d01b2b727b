"""The distributed optimizer's checkpoint formats (launch/mcore_compat.py).

'fully_sharded_model_space' (the default) is built from boxes of the model-space tensors: every
data-parallel rank writes its own slices and nothing is gathered. What must hold:
  * its files hold the tensors megatron-core's 'fully_reshardable' writes for the same state (same
    keys, same full tensors, bitwise), so the formats describe one state;
  * it resumes at another TP / PP / DP: the state loaded and saved again equals the saved one;
  * a 'fully_reshardable' checkpoint (this project's format before) still resumes at another layout.
Not marked slow (~20 s): CI's megatron-core 0.19.2 lane runs it (tests/conftest.py).
"""
import math
import random

import torch

from megatron_grpo.testing.distributed import run_distributed

FS, FR = "fully_sharded_model_space", "fully_reshardable"


def test_flat_range_boxes_cover_the_range_in_flat_order():
    from megatron_grpo.launch.mcore_compat import _flat_range_boxes

    rng = random.Random(0)
    for _ in range(2000):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 4)))
        numel = math.prod(shape)
        start = rng.randint(0, numel)
        stop = rng.randint(start, numel)
        covered = torch.zeros(shape, dtype=torch.int64)
        flat_index = torch.arange(numel).view(shape)
        at = start
        boxes = _flat_range_boxes(shape, start, stop)
        for offset, size, first in boxes:
            box = tuple(slice(o, o + s) for o, s in zip(offset, size))
            covered[box] += 1
            assert first == at and torch.equal(flat_index[box].flatten(), torch.arange(first, first + math.prod(size)))
            at += math.prod(size)
        assert at == stop or not boxes
        wanted = (torch.arange(numel) >= start) & (torch.arange(numel) < stop)
        assert torch.equal(covered.flatten(), wanted.long()), (shape, start, stop)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)


def _build(path, tp, pp):
    from megatron_grpo.convert import load_hf_weights
    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import ModelArchitecture, build_model
    from megatron_grpo.trainer.assembly.optimizer import OptimizerSettings, build_optimizer, wrap_with_ddp

    layout = ParallelLayout(tensor=tp, pipeline=pp)
    initialize_model_parallel(layout, seed=1)
    arch = ModelArchitecture.from_hf(path, vocab_multiple=8)
    chunks = build_model(arch, layout)
    load_hf_weights(chunks, arch, path)
    policy = wrap_with_ddp(chunks, use_distributed_optimizer=True)
    optimizer, _ = build_optimizer(policy, OptimizerSettings(lr=1e-3, use_distributed_optimizer=True))
    return policy, optimizer


def _save(policy, optimizer, folder, fmt):
    from megatron.core import dist_checkpointing

    from megatron_grpo.checkpointing.sharded import model_sharded_state_dict
    from megatron_grpo.launch.mcore_compat import optimizer_sharded_state_dict

    if torch.distributed.get_rank() == 0:
        folder.mkdir()
    torch.distributed.barrier()
    state = model_sharded_state_dict(policy)
    state["optimizer"] = optimizer_sharded_state_dict(optimizer, dict(state), is_loading=False, sharding_type=fmt)
    dist_checkpointing.save(state, str(folder))
    return state["optimizer"]["param_state_sharding_type"]


def _step_and_save_both(rank, world_size, path, tmp):
    """One Adam step on random gradients (different per rank), then the same state saved twice."""
    policy, optimizer = _build(path, tp=1, pp=1)
    torch.manual_seed(rank)
    for chunk in policy:
        for param in chunk.parameters():
            param.main_grad.normal_()
    optimizer.step()
    return _save(policy, optimizer, tmp / "fs", FS), _save(policy, optimizer, tmp / "fr", FR)


def _load_and_save(rank, world_size, path, tp, pp, checkpoint, fmt, out):
    """A fresh model and optimizer at this layout load `checkpoint` (saved in `fmt`) as
    trainer/state/checkpoint.py does, then save in the default format."""
    from megatron.core import dist_checkpointing

    from megatron_grpo.checkpointing.sharded import load_model_state, model_sharded_state_dict
    from megatron_grpo.launch.cpu import fix_torch_adam_step_after_load, prepare_torch_adam_for_load
    from megatron_grpo.launch.mcore_compat import optimizer_sharded_state_dict
    from megatron_grpo.launch.safe_dcp import dcp_bytes_weights_only

    policy, optimizer = _build(path, tp, pp)
    prepare_torch_adam_for_load(optimizer)
    state = model_sharded_state_dict(policy)
    state["optimizer"] = optimizer_sharded_state_dict(optimizer, dict(state), is_loading=True, sharding_type=fmt)
    with dcp_bytes_weights_only():
        loaded = dist_checkpointing.load(state, str(checkpoint))
    load_model_state(policy, loaded)
    with torch.no_grad():
        optimizer.load_state_dict(loaded["optimizer"])
    fix_torch_adam_step_after_load(optimizer)
    return _save(policy, optimizer, out, None)


def _plain_tensors(rank, world_size, folders):
    """Every tensor of each megatron checkpoint folder, as full (unsharded) tensors by key."""
    from megatron.core.dist_checkpointing import load_plain_tensors

    def flat(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from flat(value, f"{prefix}{key}.")
            elif isinstance(value, torch.Tensor):
                yield f"{prefix}{key}", value.clone()

    return [dict(flat(load_plain_tensors(str(folder)))) for folder in folders]


def test_model_space_holds_fully_reshardables_tensors_and_both_resume_at_other_layouts(tmp_path):
    from megatron_grpo.models.tiny import save_tiny_hf_model

    path = str(save_tiny_hf_model("qwen3", tmp_path / "qwen3", seed=0))
    # saved at DP 2: each rank's slices cut rows of the 2-D weights (a partial row, whole rows, a partial row)
    assert run_distributed(_step_and_save_both, 2, (path, tmp_path), timeout=240)[0] == (FS, FR)
    files = {p.name for p in (tmp_path / "fs").iterdir()}
    assert {"__0_0.distcp", "__1_0.distcp"} <= files  # both DP ranks wrote their own part
    assert {p.name for p in (tmp_path / "fr").iterdir() if p.name.startswith("__1_")} == set()  # DP rank 0 only
    # the model-space checkpoint at TP 2 (SwiGLU's fc1 halves), the fully_reshardable one at PP 2
    assert run_distributed(_load_and_save, 2, (path, 2, 1, tmp_path / "fs", FS, tmp_path / "fs_tp2"),
                           timeout=240)[0] == FS
    assert run_distributed(_load_and_save, 2, (path, 1, 2, tmp_path / "fr", FR, tmp_path / "fr_pp2"),
                           timeout=240)[0] == FS
    fs, fr, fs_tp2, fr_pp2 = run_distributed(
        _plain_tensors, 1, ([tmp_path / name for name in ("fs", "fr", "fs_tp2", "fr_pp2")],), timeout=240)[0]
    assert any(key.startswith("optimizer.state.exp_avg.") for key in fs)
    for other, label in ((fr, "fully_reshardable"), (fs_tp2, "resumed at TP2"), (fr_pp2, "fully_reshardable at PP2")):
        assert sorted(other) == sorted(fs), label
        for key, tensor in fs.items():
            assert torch.equal(other[key], tensor), (label, key)
