"""Checkpoint memory and time by distributed-optimizer format, side by side in one run (gloo, CPU).

    python benchmarks/bench_checkpoint.py            # 2 sizes x 4 layouts (not 100M x DP4) x 4 formats
    python benchmarks/bench_checkpoint.py --quick    # a smoke run: 1 size, DP2, 2 formats
    python benchmarks/bench_checkpoint.py --json out.json

Formats (what `model_optim/` holds of megatron-core's DistributedOptimizer):
  fully_reshardable   megatron-core's: at save, each grad-buffer bucket's param / exp_avg /
                      exp_avg_sq shards are all-gathered over DP (NCCL, into fp32 tensors on the
                      GPU) and copied to DP-full host tensors on every rank; DP rank 0 writes them
                      as model-space tensors. Loads at any TP / PP / DP: every rank allocates the
                      DP-full host tensors of its TP x PP part and reads them.
  fr_mem_efficient    the same with `distrib_optim_fully_reshardable_mem_efficient`: gathered with
                      gloo on the host, to DP rank 0 only. Its load is fully_reshardable's.
  dp_reshardable      megatron-core's bucket-space format: each rank writes its own shards, nothing
                      gathered; loads only at the same TP x PP.
  fully_sharded_model_space   model space without a gather (launch/mcore_compat.py: each rank's
                      slices as boxes of the model-space tensors): each rank writes its own slices;
                      loads at any TP / PP / DP, reading only the boxes it holds.

Per rank, in fresh processes (one for the save, one for the load, at the same layout):
  device  the peak of the torch tensors the save (load) creates that would live on the GPU, above
          what training holds: a TorchDispatchMode counts every new storage; a TorchFunctionMode on
          top of the CPU layer's (launch/cpu.py) files each one where a CUDA run puts it: asked for
          on the CUDA device, `.cuda()`, or made from device tensors (parameters, grad buffers,
          optimizer state), and `.cpu()` / `.to("cpu")` of a device tensor become a real host copy
          (on CPU they return the same tensor). megatron's writer clones views of CPU tensors only
          (a CUDA tensor it copies to the host later): its clones of device views cost nothing here.
          So the figures are the GPU run's, not the CPU's.
  host    the same count for host tensors (the D2H copies the checkpoint writer makes of device
          tensors included). Tensors torch makes outside its dispatcher (DCP deserialising what it
          reads) are not counted; the RSS column has them.
  RSS     VmHWM - VmRSS around the same save (load) without the tracking (VmHWM reset through
          /proc/self/clear_refs): the real CPU process, where device and host are one memory.
  time    wall time of that untracked save (load), slowest rank; files: in `model_optim/`.
The model: Qwen3 shapes (save_tiny_hf_model), fp32 (bf16 training gathers the same fp32 main
params and moments: 12 bytes per parameter), one Adam step on random gradients. megatron DDP with
overlap_grad_reduce off (as the trainer builds it) has one bucket per buffer.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
import weakref
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZES = {  # Qwen3 shapes, untied embeddings, vocabulary 256
    "10M": dict(hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                num_hidden_layers=12),
    "100M": dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=64, num_hidden_layers=8),
}
LAYOUTS = {"DP2": (1, 1, 2), "DP4": (1, 1, 4), "TP2": (2, 1, 2), "PP2": (1, 2, 2)}  # (TP, PP, world)
# 4 ranks of 100M with fully_reshardable's gather (30 N each, on top of training's 12 N) and the CPU's
# own copies need ~20 GiB: left out of the default run on a 24 GiB machine (--layouts DP4 runs it)
SKIPPED = {("100M", "DP4")}
FORMATS = ("fully_reshardable", "fr_mem_efficient", "dp_reshardable", "fully_sharded_model_space")
GB = 1e9


# ----------------------------------------------------------------------------- where tensors live


def _storage(tensor):
    try:
        return tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None


class DeviceHostBytes:
    """Bytes of the storages created while active, by where a CUDA run keeps them (see the module
    docstring); `resident` holds the tensors that live on the device before (training state)."""

    def __init__(self, resident):
        import torch
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        self.resident = {s.data_ptr() for s in map(_storage, resident) if s is not None}
        self.live = {"device": 0, "host": 0}
        self.peak = {"device": 0, "host": 0}
        self._storages: dict[int, tuple] = {}
        self._forced = None
        bytes_mode = self

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
                place = bytes_mode._forced or (
                    "device" if any(bytes_mode.place(a) == "device" for a in inputs) else "host")
                aliased = {s.data_ptr() for s in map(_storage, inputs) if s is not None}
                for value in tree_flatten(out)[0]:
                    if isinstance(value, torch.Tensor):
                        bytes_mode._see(value, place, aliased)
                return out

        class Placement(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = getattr(func, "__name__", "")
                if name in ("cuda", "cpu", "to") and args and isinstance(args[0], torch.Tensor):
                    target = {"cuda": "device", "cpu": "host"}.get(name) or _to_target(args[1:], kwargs)
                    if target is not None and bytes_mode.place(args[0]) != target:
                        with bytes_mode.placing(target):
                            out = func(*args, **kwargs)
                            if _storage(out).data_ptr() == _storage(args[0]).data_ptr():  # CPU: no copy made
                                out = out.clone()
                        return out
                if (name == "clone" and args and bytes_mode.place(args[0]) == "device"
                        and sys._getframe(1).f_code.co_name == "_clone_if_needed"):
                    # megatron's checkpoint writer clones views of CPU tensors only (a CUDA tensor is
                    # copied to the host later, whole or not): here a stand-in that costs nothing
                    with bytes_mode.placing("uncounted device"):
                        return func(*args, **kwargs)
                if _is_cuda(kwargs.get("device")):
                    with bytes_mode.placing("device"):
                        return func(*args, **kwargs)
                return func(*args, **kwargs)

        self._modes = (Placement(), Dispatch())

    @contextlib.contextmanager
    def placing(self, place):
        previous, self._forced = self._forced, place
        try:
            yield
        finally:
            self._forced = previous

    def place(self, tensor) -> str:
        storage = _storage(tensor)
        if storage is None:
            return "host"
        known = self._storages.get(id(storage))
        if known is not None and known[0]() is storage:
            return known[2]
        return "device" if storage.data_ptr() in self.resident else "host"

    def _see(self, tensor, place, aliased) -> None:
        storage = _storage(tensor)
        if tensor.device.type == "meta":
            return
        if storage is None or storage.data_ptr() in aliased or storage.data_ptr() in self.resident:
            return  # an in-place op or a view: nothing new
        key = id(storage)
        known = self._storages.get(key)
        if known is not None and known[0]() is storage:
            return
        nbytes = storage.nbytes()
        if place == "uncounted device":
            place, nbytes = "device", 0
        self._storages[key] = (weakref.ref(storage, lambda _, key=key: self._freed(key)), nbytes, place)
        self.live[place] += nbytes
        self.peak[place] = max(self.peak[place], self.live[place])

    def _freed(self, key) -> None:
        known = self._storages.pop(key, None)
        if known is not None:
            self.live[known[2]] -= known[1]

    @contextlib.contextmanager
    def tracking(self):
        """Active inside; torch.cuda.current_device() answers "cuda" so that megatron's
        device=torch.cuda.current_device() allocations show as the device ones they are."""
        import torch

        current_device = torch.cuda.current_device
        torch.cuda.current_device = lambda: torch.device("cuda")
        placement, dispatch = self._modes
        try:
            with placement, dispatch:
                yield self
        finally:
            torch.cuda.current_device = current_device


def _is_cuda(device) -> bool:
    import torch

    return (isinstance(device, str) and device.startswith("cuda")) or (
        isinstance(device, torch.device) and device.type == "cuda")


def _to_target(args, kwargs):
    """Where Tensor.to(...) moves a tensor: a CUDA device, the string "cpu" (megatron's writer), or
    None. A torch.device("cpu") says nothing on a CPU build, where it is every tensor's device (torch's
    optimizer load casts state to `param.device`, which on a GPU is the device the state is on)."""
    import torch

    for value in (*args, kwargs.get("device")):
        if _is_cuda(value):
            return "device"
        if isinstance(value, str) and torch.device(value).type == "cpu":
            return "host"
    return None


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


@contextlib.contextmanager
def rss_peak(result: dict, key: str):
    """result[key] = the peak RSS increase inside (VmHWM reset first)."""
    Path("/proc/self/clear_refs").write_text("5")
    before = _kib("VmRSS")
    yield
    result[key] = _kib("VmHWM") - before


# ----------------------------------------------------------------------------- one rank


def _build(path: str, tp: int, pp: int, step: bool):
    import torch

    from megatron_grpo.convert import load_hf_weights
    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import ModelArchitecture, build_model
    from megatron_grpo.trainer.assembly.optimizer import OptimizerSettings, build_optimizer, wrap_with_ddp

    torch.set_num_threads(1)
    layout = ParallelLayout(tensor=tp, pipeline=pp)
    initialize_model_parallel(layout, seed=1)
    mc = ModelArchitecture.from_hf(path, vocab_multiple=8)
    chunks = build_model(mc, layout)
    load_hf_weights(chunks, mc, path)
    policy = wrap_with_ddp(chunks, use_distributed_optimizer=True)
    optimizer, _ = build_optimizer(policy, OptimizerSettings(lr=1e-4, use_distributed_optimizer=True))
    if step:
        torch.manual_seed(torch.distributed.get_rank())
        for chunk in policy:
            for param in chunk.parameters():
                param.main_grad.normal_()
        optimizer.step()
    return policy, optimizer


def _resident(policy, optimizer):
    """What a CUDA run holds on the device: parameters, grad buffers, optimizer state."""
    import torch

    for chunk in policy:
        for buffer in chunk.buffers:
            yield buffer.param_data
            yield buffer.grad_data
        yield from chunk.parameters()
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in inner.optimizer.param_groups:
            yield from group["params"]
        for state in inner.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _fc1_share(policy) -> float:
    """The SwiGLU fc1 weights' share of this rank's parameters."""
    total = fc1 = 0
    for chunk in policy:
        for name, param in chunk.named_parameters():
            total += param.numel()
            fc1 += param.numel() if name.endswith("linear_fc1.weight") else 0
    return fc1 / total


def _local_numel(optimizer) -> tuple[int, int]:
    """(elements of this rank's grad buffers = its TP x PP part of the model, DP size)."""
    numel, dp = 0, 1
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        dp = inner.data_parallel_group.size()
        numel += sum(bucket.grad_data.numel() for buffer in inner.buffers for bucket in buffer.buckets)
    return numel, dp


def _optimizer_state(optimizer, model_state: dict, fmt: str, is_loading: bool) -> dict:
    from megatron_grpo.launch import mcore_compat

    if fmt == "fr_mem_efficient":
        metadata = {"distrib_optim_sharding_type": "fully_reshardable",
                    "distrib_optim_fully_reshardable_mem_efficient": True}
        return optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=metadata)
    return mcore_compat.optimizer_sharded_state_dict(optimizer, model_state, is_loading=is_loading,
                                                     sharding_type=fmt)


def _save_once(policy, optimizer, fmt: str, folder: Path) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_grpo.checkpointing.sharded import model_sharded_state_dict

    if dist.get_rank() == 0:
        folder.mkdir(parents=True)
    dist.barrier()
    state = model_sharded_state_dict(policy)
    state["optimizer"] = _optimizer_state(optimizer, dict(state), fmt, is_loading=False)
    dist_checkpointing.save(state, str(folder))
    del state


def _load_once(policy, optimizer, fmt: str, folder: Path) -> None:
    import torch
    from megatron.core import dist_checkpointing

    from megatron_grpo.checkpointing.sharded import load_model_state, model_sharded_state_dict
    from megatron_grpo.launch.safe_dcp import dcp_bytes_weights_only

    state = model_sharded_state_dict(policy)
    load_format = "fully_reshardable" if fmt == "fr_mem_efficient" else fmt
    state["optimizer"] = _optimizer_state(optimizer, dict(state), load_format, is_loading=True)
    with dcp_bytes_weights_only():
        loaded = dist_checkpointing.load(state, str(folder))
    load_model_state(policy, loaded)
    with torch.no_grad():
        optimizer.load_state_dict(loaded["optimizer"])
    del state, loaded


def _timed(action, *args) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    action(*args)
    dist.barrier()
    return time.perf_counter() - start


def _save_rank(rank, world_size, path, tp, pp, fmt, folder):
    """Tracked save into folder/tracked, then the timed and RSS-measured one into folder/model_optim."""
    policy, optimizer = _build(path, tp, pp, step=True)
    numel, dp = _local_numel(optimizer)
    tracker = DeviceHostBytes(_resident(policy, optimizer))
    with tracker.tracking():
        _save_once(policy, optimizer, fmt, Path(folder) / "tracked")
    result = {"rank": rank, "numel": numel, "dp": dp, "fc1": _fc1_share(policy), "device": tracker.peak["device"],
              "host": tracker.peak["host"]}
    with rss_peak(result, "rss"):
        result["seconds"] = _timed(_save_once, policy, optimizer, fmt, Path(folder) / "model_optim")
    return result


def _load_rank(rank, world_size, path, tp, pp, fmt, folder):
    from megatron_grpo.launch.cpu import prepare_torch_adam_for_load

    policy, optimizer = _build(path, tp, pp, step=False)
    prepare_torch_adam_for_load(optimizer)
    tracker = DeviceHostBytes(_resident(policy, optimizer))
    with tracker.tracking():
        _load_once(policy, optimizer, fmt, Path(folder) / "model_optim")
    result = {"rank": rank, "device": tracker.peak["device"], "host": tracker.peak["host"]}
    with rss_peak(result, "rss"):
        result["seconds"] = _timed(_load_once, policy, optimizer, fmt, Path(folder) / "model_optim")
    return result


# ----------------------------------------------------------------------------- the run


def measure(size: str, layout: str, fmt: str, model_path: str, folder: Path) -> dict:
    from megatron_grpo.testing.distributed import run_distributed

    tp, pp, world = LAYOUTS[layout]
    saved = run_distributed(_save_rank, world, args=(model_path, tp, pp, fmt, str(folder)), timeout=1800)
    loaded = run_distributed(_load_rank, world, args=(model_path, tp, pp, fmt, str(folder)), timeout=1800)
    files = sum(1 for p in (folder / "model_optim").rglob("*") if p.is_file())
    return {"size": size, "layout": layout, "format": fmt, "numel": max(r["numel"] for r in saved),
            "dp": saved[0]["dp"], "fc1": saved[0]["fc1"], "files": files,
            **{f"save_{k}": max(r[k] for r in saved) for k in ("device", "host", "rss", "seconds")},
            **{f"load_{k}": max(r[k] for r in loaded) for k in ("device", "host", "rss", "seconds")},
            "save_host_by_rank": [r["host"] for r in saved]}


def predicted(fmt: str, n: float, dp: int, fc1: float, weight_bytes: int) -> dict:
    """Extra bytes per rank (the largest rank), N = elements of the rank's TP x PP part (its grad
    buffer: one bucket), D = DP, fc1 = the SwiGLU fc1 weights' share of N, w = bytes per weight.
      fully_reshardable  save, device: one state key gathered (4N) + the GPU copy of the local shard
                         (4N/D). save, host (every rank gathers): the DP-full fp32 tensors (12N) + the
                         three local shards (12N/D) + the gathered key's host copy (4N) and two
                         concatenations (the previous key's is still referenced: 8N); then, on DP rank
                         0 while the writer prepares, the world tensors + the writer's clone of every
                         view into them (12N) + the D2H copy of the weights it writes (wN): the larger.
                         load, host: the DP-full tensors (12N) + the SwiGLU factory's concatenation of
                         the fc1 state (12 fc1 N).
      fr_mem_efficient   the same host figures on DP rank 0 (gloo into host tensors), nothing on the GPU.
      dp_reshardable / fully_sharded_model_space: save, host: the writer's D2H copy of the rank's
                         state slices (12N/D) + the weights DP rank 0 writes (wN). load: nothing above
                         the read buffers.
      Every format's load: the fc1 weights concatenated on the device (w fc1 N), megatron's SwiGLU
      factory for the model itself."""
    load_device = weight_bytes * fc1 * n
    if fmt in ("fully_reshardable", "fr_mem_efficient"):
        device = (4 * n + 4 * n / dp) if fmt == "fully_reshardable" else 0.0
        host = max(24 * n + 12 * n / dp, 24 * n + weight_bytes * n)
        return {"save_device": device, "save_host": host, "load_device": load_device,
                "load_host": 12 * n + 12 * fc1 * n}
    return {"save_device": 0.0, "save_host": 12 * n / dp + weight_bytes * n, "load_device": load_device,
            "load_host": 0.0}


LLAMA_70B = {"params": 70.55e9, "fc1": 2 * 28672 * 8192 * 80 / 70.55e9}  # Llama-3-70B: 80 layers, FFN 28672


def llama70b(tp: int, pp: int, dp: int) -> dict:
    n = LLAMA_70B["params"] / (tp * pp)
    return {fmt: predicted(fmt, n, dp, LLAMA_70B["fc1"], weight_bytes=2) for fmt in FORMATS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10M, DP2, fully_reshardable vs model space: a smoke run")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES))
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS))
    parser.add_argument("--formats", nargs="+", choices=FORMATS)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    import tempfile

    from megatron_grpo.models.tiny import save_tiny_hf_model

    sizes = args.sizes or (["10M"] if args.quick else list(SIZES))
    layouts = args.layouts or (["DP2"] if args.quick else list(LAYOUTS))
    formats = args.formats or (["fully_reshardable", "fully_sharded_model_space"] if args.quick else list(FORMATS))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            model_path = str(save_tiny_hf_model("qwen3", Path(tmp) / size, seed=0, vocab_size=256,
                                                tie_word_embeddings=False, **SIZES[size]))
            for layout in layouts:
                if (size, layout) in SKIPPED and not args.layouts:
                    continue
                for fmt in formats:
                    rows.append(measure(size, layout, fmt, model_path, Path(tmp) / f"{size}-{layout}-{fmt}"))
                    print(f"  {size} {layout} {fmt}: done", file=sys.stderr, flush=True)
    print("Per rank, the largest over ranks; N = elements of a rank's TP x PP part; extra = above what training "
          "holds. GPU-equivalent device / host: tensors counted where a CUDA run keeps them; RSS: this CPU process.\n")
    print("| size | layout | format | N | save device | save host | save RSS | save s | load device | load host "
          "| load RSS | load s | files |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mib = {k: f"{r[k] / 2**20:.0f} MiB" for k in ("save_device", "save_host", "save_rss", "load_device",
                                                      "load_host", "load_rss")}
        print(f"| {r['size']} | {r['layout']} | {r['format']} | {r['numel'] / 1e6:.1f}M | {mib['save_device']} "
              f"| {mib['save_host']} | {mib['save_rss']} | {r['save_seconds']:.2f} | {mib['load_device']} "
              f"| {mib['load_host']} | {mib['load_rss']} | {r['load_seconds']:.2f} | {r['files']} |")
    print("\nMeasured / formula, in bytes per element of N (fp32 weights, w = 4):\n\n| size | layout | format "
          "| fc1 share | save device | save host | load device | load host |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        f = predicted(r["format"], r["numel"], r["dp"], r["fc1"], weight_bytes=4)
        cells = " | ".join(f"{r[k] / r['numel']:.2f} / {f[k] / r['numel']:.2f}"
                           for k in ("save_device", "save_host", "load_device", "load_host"))
        print(f"| {r['size']} | {r['layout']} | {r['format']} | {r['fc1']:.2f} | {cells} |")
    print(f"\nLlama-3-70B ({LLAMA_70B['params'] / 1e9:.2f}B parameters, fc1 share {LLAMA_70B['fc1']:.2f}, bf16 "
          "weights), per rank, from the formulas:\n\n| layout | N | format | save device | save host | load device "
          "| load host |\n|---|---|---|---|---|---|---|")
    for dp in (4, 8):
        for fmt, f in llama70b(8, 2, dp).items():
            gb = " | ".join(f"{f[k] / GB:.1f} GB" for k in ("save_device", "save_host", "load_device", "load_host"))
            print(f"| TP8 x PP2 x DP{dp} | {LLAMA_70B['params'] / 16 / 1e9:.2f}B | {fmt} | {gb} |")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "llama70b": {dp: llama70b(8, 2, dp) for dp in (4, 8)}},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
