"""tools/sglang_cpu/sgl_kernel, the stand-in for SGLang's CPU kernel package, against SGLang's own
code for the same operations.

Each stand-in function is run by SGLang 0.5.23's own caller (the dispatcher that picks it on a CPU)
and compared bitwise with what the same caller computes on its GPU branch: SGLang's Triton kernel,
run on this CPU by Triton's interpreter (TRITON_INTERPRET=1, read by @triton.jit when SGLang's
modules are imported, so all of it runs in one subprocess of the runtime venv: this file run as a
script). The KV-cache copy is also compared with SGLang's torch-native move (move_kv_cache_native).

The same subprocess checks that SGLang's callers still exist with the signatures the stand-in was
written for, and that every other name SGLang imports from sgl_kernel imports and, when called,
raises NotImplementedError naming itself: an SGLang upgrade that changes any of this fails here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang_runtime]

IMPLEMENTED = ("copy_all_layer_kv_cache_cpu", "assign_req_to_token_pool_cpu")


# ---------------------------------------------------------------- the tests (any interpreter)

@pytest.fixture(scope="module")
def report() -> dict:
    from tests.sglang_runtime_fixtures import runtime_python

    python = runtime_python()
    # SGLANG_USE_CPU_ENGINE=1: SGLang's modules import the stand-in as on a CPU engine
    env = {**os.environ, "TRITON_INTERPRET": "1", "SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([python, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the comparison script failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_sglang_imports_the_stand_in(report):
    """SGLang's modules bound the two helpers to the stand-in (not to some other sgl_kernel)."""
    assert report["stand_in_file"].endswith("tools/sglang_cpu/sgl_kernel/__init__.py"), report["stand_in_file"]
    assert report["bound"] == {"copy_all_layer_kv_cache_cpu": True, "assign_req_to_token_pool_cpu": True}


def test_sglang_call_sites_are_the_ones_the_stand_in_was_written_for(report):
    """SGLang's dispatchers, their Triton kernels and the code that calls them, at the names and
    with the arguments of 0.5.23; the CPU branch passes the stand-in what it expects."""
    assert report["call_sites"] == {
        "copy_all_layer_kv_cache_func": ["data_ptrs", "strides", "tgt_loc", "src_loc", "num_locs", "num_locs_upper",
                                         "kv_copy_config"],
        "copy_all_layer_kv_cache_tiled": ["data_ptrs", "strides", "tgt_loc_ptr", "src_loc_ptr", "num_locs",
                                          "num_locs_upper", "BYTES_PER_TILE"],
        "assign_req_to_token_pool_func": ["req_pool_indices", "req_to_token", "start_offset", "end_offset",
                                          "out_cache_loc", "batch_size"],
        "assign_req_to_token_pool": ["req_pool_indices", "req_to_token", "start_offset", "end_offset",
                                     "out_cache_loc", "pool_len", "bs_upper"],
        "MHATokenToKVPool.move_kv_cache calls copy_all_layer_kv_cache_func": True,
        "alloc_for_spec_decode calls assign_req_to_token_pool_func": True,
    }
    # what the CPU branches hand the stand-in: 4 and 6 positional arguments, the locations cut to num_locs
    assert report["cpu_branch_calls"] == {
        "copy_all_layer_kv_cache_cpu": {"args": 4, "kwargs": [], "tgt_len": 3, "src_len": 3},
        "assign_req_to_token_pool_cpu": {"args": 6, "kwargs": [], "pool_len_is_row_length": True},
    }


def test_copy_all_layer_kv_cache_matches_sglang_triton_and_torch(report):
    cases = report["copy"]
    assert len(cases) >= 12
    kinds = {kind for case in cases for kind in case["kinds"]}
    # what the cases cover, so that a change of the generator cannot quietly drop one
    assert {"float32", "bfloat16", "uint8", "mixed dtypes", "K wider than V", "in place", "duplicate sources",
            "chunked", "several tiles", "empty", "warm-up"} <= kinds, kinds
    bad = [case for case in cases if not case["stand_in_equals_triton"] or case["stand_in_equals_native"] is False]
    assert not bad, bad
    # SGLang's torch-native move is a second reference wherever SGLang moves in one piece
    assert sum(case["stand_in_equals_native"] is True for case in cases) >= 10
    # the comparison is not vacuous: the reference moved rows wherever there was something to move
    assert all(case["triton_changed_rows"] for case in cases if case["moves_rows"]), cases


def test_assign_req_to_token_pool_matches_sglang_triton(report):
    cases = report["assign"]
    assert len(cases) >= 8
    assert {"empty requests", "longer than a block", "one request", "int32 offsets"} <= {
        kind for case in cases for kind in case["kinds"]}
    bad = [case for case in cases if not case["stand_in_equals_triton"]]
    assert not bad, bad
    assert all(case["triton_changed_table"] for case in cases), cases


def test_every_other_kernel_name_raises_naming_itself(report):
    names = report["other_names"]
    # SGLang 0.5.23 imports well over a hundred names from sgl_kernel (GPU and CPU paths): each one
    # imports from the stand-in, and calling it raises NotImplementedError naming it
    assert len(names) > 50 and not set(IMPLEMENTED) & set(names)
    bad = {name: outcome for name, outcome in names.items() if outcome != "NotImplementedError naming it"}
    assert not bad, bad
    # the speculative-decoding modules that `from sgl_kernel import X_cpu` at import on a CPU engine
    assert report["speculative_imports"] == {
        "sglang.kernels.ops.speculative.eagle": {"fill_accept_out_cache_loc_cpu": "NotImplementedError naming it",
                                                 "fill_bonus_tokens_cpu": "NotImplementedError naming it"},
        "sglang.kernels.ops.speculative.multi_layer_eagle": {"rotate_input_ids_cpu": "NotImplementedError naming it"},
        "sglang.kernels.ops.speculative.spec_tree": {
            "sgl_build_tree_kernel_efficient_cpu": "NotImplementedError naming it",
            "sgl_verify_tree_greedy_cpu": "NotImplementedError naming it"},
    }
    assert report["dunder"] == "AttributeError"  # copy/pickle/inspect probes of __x__ are not kernels


# ------------------------------------------------- the comparison (runtime venv, TRITON_INTERPRET=1)

def _bytes(tensors) -> list:
    import torch

    return [t.contiguous().view(-1).view(torch.uint8).clone() for t in tensors]


def _same(a, b) -> bool:
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _outcome(function, name: str) -> str:
    try:
        function()
    except NotImplementedError as exc:
        return "NotImplementedError naming it" if f"sgl_kernel.{name}" in str(exc) else f"NotImplementedError: {exc}"
    except Exception as exc:  # the outcome is what is compared
        return f"{type(exc).__name__}: {exc}"
    return "returned"


class _CpuBranch:
    """Runs SGLang's dispatchers on their GPU branch (Triton) while the flag is off."""

    def __init__(self, *modules):
        self.modules = modules

    def __call__(self, on: bool):
        for module in self.modules:
            module._is_cpu = on


def _copy_cases(torch, memory_pool, cache_move, branch) -> list[dict]:
    """SGLang's MHATokenToKVPool (its buffers, data_ptrs / data_strides, tile configuration and
    warm-up) moving rows with move_kv_cache: on the CPU branch (the stand-in), the GPU branch
    (Triton) and the torch-native move."""
    MHATokenToKVPool = memory_pool.MHATokenToKVPool

    def pool(size, dtype, heads, head_dim, v_head_dim, layers, cpu):
        branch(cpu)
        try:  # the constructor's warm-up copy runs on the chosen branch too
            return MHATokenToKVPool(size=size, page_size=1, dtype=dtype, head_num=heads, head_dim=head_dim,
                                    layer_num=layers, device="cpu", enable_memory_saver=False,
                                    v_head_dim=v_head_dim, enable_kv_cache_copy=True)
        finally:
            branch(True)

    def fill(pools, generator):
        first = pools[0]
        for index, buffer in enumerate([*first.k_buffer, *first.v_buffer]):
            if buffer.dtype.is_floating_point:
                data = torch.randn(buffer.shape, generator=generator).to(buffer.dtype)
            else:
                data = torch.randint(-128, 128, buffer.shape, generator=generator, dtype=torch.int16).to(buffer.dtype)
            for other in pools:
                [*other.k_buffer, *other.v_buffer][index].copy_(data)

    def mixed(target):
        """K and V buffers of different dtypes and row widths in one pool, widest first: SGLang sizes
        the copy's tiles from buffer 0's row (data_strides[0]), as its K-before-V order guarantees."""
        shapes = [(torch.float32, 4, 16), (torch.bfloat16, 2, 16), (torch.uint8, 3, 8), (torch.bfloat16, 1, 8)]
        rows = target.k_buffer[0].shape[0]
        buffers = [torch.zeros(rows, heads, dim, dtype=dtype) for dtype, heads, dim in shapes]
        target.k_buffer, target.v_buffer = buffers[:2], buffers[2:]
        target.layer_num = 2
        target._init_data_ptrs_and_strides()
        target._init_kv_copy_and_warmup()

    cases = []
    specs = [  # (seed, size, dtype, heads, head_dim, v_head_dim, layers, moves, kinds)
        (0, 64, torch.float32, 2, 8, 8, 2, "random", ["float32"]),
        (1, 96, torch.bfloat16, 4, 16, 8, 3, "random", ["bfloat16", "K wider than V"]),
        (2, 80, torch.float8_e4m3fn, 2, 32, 16, 2, "random", ["uint8", "K wider than V"]),
        (3, 64, torch.float32, 2, 8, 4, 1, "cycle", ["float32", "in place", "K wider than V"]),
        (4, 64, torch.bfloat16, 1, 8, 8, 2, "cycle", ["bfloat16", "in place"]),
        (5, 128, torch.float32, 3, 8, 8, 2, "overlap", ["float32", "in place", "duplicate sources"]),
        (6, 48, torch.float8_e4m3fn, 1, 24, 24, 1, "overlap", ["uint8", "in place", "duplicate sources"]),
        (7, 32, torch.float32, 2, 8, 8, 1, "empty", ["empty"]),
        (8, 512, torch.float32, 16, 128, 128, 1, "chunked", ["float32", "chunked", "several tiles"]),
        (9, 320, torch.bfloat16, 8, 256, 128, 1, "chunked", ["bfloat16", "chunked", "several tiles",
                                                             "K wider than V"]),
        (10, 64, torch.float32, 2, 8, 8, 1, "mixed", ["mixed dtypes", "in place", "duplicate sources"]),
        (11, 100, torch.bfloat16, 2, 8, 8, 2, "mixed", ["mixed dtypes", "in place", "duplicate sources"]),
        (12, 64, torch.float32, 2, 8, 8, 2, "warm-up", ["warm-up"]),
    ]
    for seed, size, dtype, heads, head_dim, v_head_dim, layers, moves, kinds in specs:
        generator = torch.Generator().manual_seed(seed)
        stand_in, triton, native = (pool(size, dtype, heads, head_dim, v_head_dim, layers, cpu)
                                    for cpu in (True, False, True))
        if moves == "mixed":
            for target, cpu in ((stand_in, True), (triton, False), (native, True)):
                branch(cpu)
                mixed(target)
                branch(True)
        fill([stand_in, triton, native], generator)
        slots = size + 1  # SGLang's pools keep one padding slot
        if moves == "empty":
            tgt = src = torch.zeros(0, dtype=torch.int64)
        elif moves == "warm-up":  # what the constructor's warm-up does, once more on filled buffers
            tgt = src = None
        else:
            count = {"chunked": 300}.get(moves, int(torch.randint(2, slots // 2, (1,), generator=generator)))
            tgt = torch.randperm(slots, generator=generator)[:count]  # distinct targets (the Triton kernel
            # stores all rows of a tile at once: duplicate targets have no defined winner there)
            if moves == "cycle":  # a permutation of the slots it touches: each is read and written
                src = tgt.roll(1)
            elif moves in ("overlap", "mixed"):  # half the sources are targets too, with repeats
                src = torch.where(torch.rand(count, generator=generator) < 0.5,
                                  tgt[torch.randint(0, count, (count,), generator=generator)],
                                  torch.randint(0, slots, (count,), generator=generator))
            else:
                src = torch.randint(0, slots, (count,), generator=generator)
        before = _bytes([*triton.k_buffer, *triton.v_buffer])
        for target, cpu in ((stand_in, True), (triton, False)):
            branch(cpu)
            if tgt is None:
                cfg = target._kv_copy_config
                dummy = torch.zeros(cfg["num_locs_upper"], dtype=torch.int64)
                memory_pool.copy_all_layer_kv_cache_func(target.data_ptrs, target.data_strides, dummy, dummy, 1,
                                                         cfg["num_locs_upper"], cfg)
            else:
                target.move_kv_cache(tgt, src)
            branch(True)
        if tgt is not None:
            memory_pool.move_kv_cache_native(native.k_buffer, native.v_buffer, tgt, src)
        got = {name: _bytes([*p.k_buffer, *p.v_buffer]) for name, p in
               (("stand_in", stand_in), ("triton", triton), ("native", native))}
        locations = 0 if tgt is None else int(tgt.numel())
        # Over num_locs_upper locations SGLang moves chunk after chunk (_move_kv_cache_impl), each
        # chunk reading what the previous ones wrote, while its torch-native move reads every source
        # first: the two differ there (on a GPU too), and the stand-in, called per chunk, is the former.
        chunked = locations > triton._kv_copy_config["num_locs_upper"]
        cases.append({"seed": seed, "kinds": kinds, "locations": locations,
                      "row_bytes": triton.data_strides.tolist(), "config": triton._kv_copy_config,
                      "moves_rows": tgt is not None and bool((tgt != src).any()),
                      "stand_in_equals_triton": _same(got["stand_in"], got["triton"]),
                      "stand_in_equals_native": None if chunked else _same(got["stand_in"], got["native"]),
                      "triton_changed_rows": not _same(before, got["triton"])})
    return cases


def _assign_cases(torch, allocation, memory_pool, branch) -> list[dict]:
    """SGLang's assign_req_to_token_pool_func on SGLang's ReqToTokenPool table, as
    alloc_for_spec_decode calls it: on the CPU branch (the stand-in) and the GPU branch (Triton)."""
    cases = []
    specs = [  # (seed, pool rows, pool_len, requests, longest, kinds)
        (0, 8, 64, 3, 16, ["several requests"]),
        (1, 16, 100, 6, 80, ["several requests", "longer than a block"]),
        (2, 4, 37, 1, 37, ["one request"]),
        (3, 32, 512, 9, 300, ["several requests", "longer than a block"]),
        (4, 8, 64, 5, 0, ["empty requests"]),
        (5, 12, 200, 7, 70, ["several requests", "empty requests", "longer than a block"]),
        (6, 6, 33, 4, 33, ["several requests", "int32 offsets"]),
        (7, 64, 1000, 17, 129, ["several requests", "longer than a block"]),
    ]
    for seed, rows, pool_len, requests, longest, kinds in specs:
        generator = torch.Generator().manual_seed(seed)
        tables = [memory_pool.ReqToTokenPool(size=rows, max_context_len=pool_len, device="cpu",
                                             enable_memory_saver=False) for _ in range(2)]
        fill = torch.randint(0, 1 << 30, tables[0].req_to_token.shape, generator=generator, dtype=torch.int32)
        for table in tables:
            table.req_to_token.copy_(fill)
        indices = torch.randperm(rows + 1, generator=generator)[:requests]  # distinct rows, padding row 0 too
        start = torch.randint(0, pool_len, (requests,), generator=generator)
        if longest == 0:  # every request asks nothing, but one: SGLang calls it with some tokens only
            end = start.clone()
            end[-1] = min(pool_len, int(start[-1]) + 1)
        else:
            end = torch.minimum(start + torch.randint(0, longest + 1, (requests,), generator=generator),
                                torch.tensor(pool_len))
            end[0] = start[0]  # one request with nothing to write among the others
            if requests == 1:
                start, end = torch.tensor([0]), torch.tensor([pool_len])
        offsets_dtype = torch.int32 if "int32 offsets" in kinds else torch.int64
        start, end = start.to(offsets_dtype), end.to(offsets_dtype)
        out_cache_loc = torch.randint(0, 1 << 20, (int((end - start).sum()),), generator=generator)
        before = tables[1].req_to_token.clone()
        for table, cpu in zip(tables, (True, False)):
            branch(cpu)
            allocation.assign_req_to_token_pool_func(indices, table.req_to_token, start, end, out_cache_loc,
                                                     requests)
            branch(True)
        cases.append({"seed": seed, "kinds": kinds, "tokens": int(out_cache_loc.numel()), "pool_len": pool_len,
                      "stand_in_equals_triton": torch.equal(tables[0].req_to_token, tables[1].req_to_token),
                      "triton_changed_table": not torch.equal(before, tables[1].req_to_token)})
    return cases


def _call_sites(torch, inspect, cache_move, allocation, memory_pool) -> tuple[dict, dict]:
    def parameters(function):
        return list(inspect.signature(function).parameters)

    sites = {
        "copy_all_layer_kv_cache_func": parameters(cache_move.copy_all_layer_kv_cache_func),
        "copy_all_layer_kv_cache_tiled": list(cache_move.copy_all_layer_kv_cache_tiled.arg_names),
        "assign_req_to_token_pool_func": parameters(allocation.assign_req_to_token_pool_func),
        "assign_req_to_token_pool": list(allocation.assign_req_to_token_pool.arg_names),
        "MHATokenToKVPool.move_kv_cache calls copy_all_layer_kv_cache_func":
            "copy_all_layer_kv_cache_func(" in inspect.getsource(memory_pool.MHATokenToKVPool._move_kv_cache_impl)
            and "_move_kv_cache_impl(" in inspect.getsource(memory_pool.MHATokenToKVPool.move_kv_cache),
        "alloc_for_spec_decode calls assign_req_to_token_pool_func":
            "assign_req_to_token_pool_func(" in inspect.getsource(allocation.alloc_for_spec_decode),
    }
    # what SGLang's CPU branches pass: recorded by swapping the name the module bound
    calls = {}

    def recorder(name, describe):
        def record(*args, **kwargs):
            calls[name] = {"args": len(args), "kwargs": sorted(kwargs), **describe(args)}
        return record

    saved = cache_move.copy_all_layer_kv_cache_cpu, allocation.assign_req_to_token_pool_cpu
    try:
        cache_move.copy_all_layer_kv_cache_cpu = recorder(
            "copy_all_layer_kv_cache_cpu", lambda a: {"tgt_len": len(a[2]), "src_len": len(a[3])})
        allocation.assign_req_to_token_pool_cpu = recorder(
            "assign_req_to_token_pool_cpu", lambda a: {"pool_len_is_row_length": a[5] == a[1].shape[1]})
        locs = torch.arange(8)
        cache_move.copy_all_layer_kv_cache_func(torch.zeros(1, dtype=torch.uint64), torch.ones(1), locs, locs, 3, 4,
                                                {})
        allocation.assign_req_to_token_pool_func(locs[:1], torch.zeros(2, 5, dtype=torch.int32), locs[:1],
                                                 locs[1:2], locs[:1], 1)
    finally:
        cache_move.copy_all_layer_kv_cache_cpu, allocation.assign_req_to_token_pool_cpu = saved
    return sites, calls


def _other_names(ast, re, sgl_kernel) -> dict[str, str]:
    """Every name any SGLang module imports from sgl_kernel (GPU and CPU paths), called. Each
    `from sgl_kernel import ...` statement is cut out and parsed alone (parsing all of SGLang's
    modules that mention sgl_kernel takes seconds)."""
    import sglang

    statement = re.compile(r"^[ \t]*from sgl_kernel import (\([^)]*\)|[^\n]*)", re.MULTILINE)
    names = set()
    for path in Path(sglang.__file__).parent.rglob("*.py"):
        for match in statement.finditer(path.read_text(errors="replace")):
            node = ast.parse(match.group(0).strip()).body[0]
            names.update(alias.name for alias in node.names if alias.name != "*")
    return {name: _outcome(getattr(sgl_kernel, name), name) for name in sorted(names - set(IMPLEMENTED))}


def main() -> None:
    import ast
    import importlib
    import inspect
    import re

    import torch

    assert os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"
    from sglang.kernels.ops.kvcache import cache_move
    from sglang.srt.mem_cache import allocation, memory_pool

    import sgl_kernel

    assert cache_move._is_cpu and allocation._is_cpu, "SGLang did not take its CPU path"
    branch = _CpuBranch(cache_move, allocation)
    sites, calls = _call_sites(torch, inspect, cache_move, allocation, memory_pool)
    speculative = {}
    for module_name, bound in (("sglang.kernels.ops.speculative.eagle",
                                ("fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu")),
                               ("sglang.kernels.ops.speculative.multi_layer_eagle", ("rotate_input_ids_cpu",)),
                               ("sglang.kernels.ops.speculative.spec_tree",
                                ("sgl_build_tree_kernel_efficient_cpu", "sgl_verify_tree_greedy_cpu"))):
        module = importlib.import_module(module_name)
        speculative[module_name] = {name: _outcome(getattr(module, name), getattr(module, name).__name__)
                                    for name in bound}
    dunder = "returned" if hasattr(sgl_kernel, "__wrapped__") else "AttributeError"
    print(json.dumps({
        "stand_in_file": sgl_kernel.__file__,
        "bound": {"copy_all_layer_kv_cache_cpu":
                  cache_move.copy_all_layer_kv_cache_cpu is sgl_kernel.copy_all_layer_kv_cache_cpu,
                  "assign_req_to_token_pool_cpu":
                  allocation.assign_req_to_token_pool_cpu is sgl_kernel.assign_req_to_token_pool_cpu},
        "call_sites": sites, "cpu_branch_calls": calls,
        "copy": _copy_cases(torch, memory_pool, cache_move, branch),
        "assign": _assign_cases(torch, allocation, memory_pool, branch),
        "other_names": _other_names(ast, re, sgl_kernel), "speculative_imports": speculative, "dunder": dunder,
    }))


if __name__ == "__main__":
    sys.path.remove(str(Path(__file__).resolve().parent))  # tests/ (requirements.py...) shadows no package
    main()
