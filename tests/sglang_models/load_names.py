"""Run with SGLang's interpreter (build/sglang-venv): feeds an HF-named weight stream to SGLang
0.5.23's OWN model class for the checkpoint's architecture and reports what its `load_weights`
did with each name. SGLang renames, stacks (q/k/v, gate/up, per-expert -> FusedMoE w13/w2) and
silently skips names it does not know; this reports it from SGLang's code, not from a list of ours.

    python -m tests.sglang_models.load_names MODEL_DIR STREAM.safetensors OUT.json [TOGETHER.json]

The model is built on CPU at TP 1 in one process (SGLang's own parallel groups over gloo); every
parameter is filled with NaN first; the stream is fed one tensor per load_weights call, and a
tensor counts as loaded when exactly tensor.numel() NaN elements of the model were overwritten by
it. Out: {"written": {name: elements overwritten}, "left": {parameter: NaN elements left},
"parameters": {parameter: shape}}. TOGETHER.json, a list of name groups (convert.mappings.sglang_load_together:
DeepSeek's q_a_proj + kv_a_proj_with_mqa, which SGLang fuses only within one call): each group is fed in one
call, when its last member arrives, and reported under "groups" {"a + b": elements written}. Nothing SGLang
runs here computes: the rotary kernel import that
SGLang's CPU-less platform check asks for (vllm._custom_ops) is an empty stand-in."""
from __future__ import annotations

import json
import os
import socket
import sys
import types


def _stand_ins() -> None:
    from tests.sglang_harness import memory_saver_stub, torchvision_stub

    torchvision_stub.install()
    memory_saver_stub.install()
    for name in ("vllm", "vllm._custom_ops"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["vllm._custom_ops"].rotary_embedding = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_sglang_model(model_dir: str):
    """SGLang's model class for model_dir's config (as tests/sglang_harness resolves it), built at TP 1."""
    import torch
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs
    from transformers import AutoConfig

    publish(ServerArgs(model_path=model_dir, device="cpu"), role="scheduler", ranks=SpawnRanks(world_rank=0))
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
    initialize_model_parallel()
    config = AutoConfig.from_pretrained(model_dir)
    cls = _entry_class(config.model_type, config.architectures[0])
    torch.set_default_dtype(torch.float32)
    return cls(config)


def _entry_class(model_type: str, architecture: str):
    """SGLang's registry's answer (sglang.srt.models.registry: the EntryClass of that name in any module of
    sglang.srt.models) without importing every model module: the module named after model_type, else the
    one whose source defines the class (DeepseekV3ForCausalLM lives in deepseek_v2.py)."""
    import importlib
    import importlib.util
    from pathlib import Path

    import sglang.srt.models as models

    candidates = [model_type] if importlib.util.find_spec(f"sglang.srt.models.{model_type}") else []
    candidates += sorted(f.stem for path in models.__path__ for f in Path(path).glob("*.py")
                         if f"class {architecture}(" in f.read_text(errors="replace"))
    for name in candidates:
        module = importlib.import_module(f"sglang.srt.models.{name}")
        entries = getattr(module, "EntryClass", [])
        entries = entries if isinstance(entries, list) else [entries]
        found = [c for c in entries if c.__name__ == architecture]
        if found:
            return found[0]
    raise LookupError(f"no SGLang EntryClass named {architecture}")


def main(argv) -> int:
    model_dir, stream_file, out, *together = argv
    groups = [tuple(g) for g in json.load(open(together[0]))] if together else []
    group_of = {name: group for group in groups for name in group}
    _stand_ins()
    import torch
    from safetensors.torch import load_file

    model = build_sglang_model(model_dir)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))

    def nans() -> int:
        return sum(int(torch.isnan(p).sum()) for p in params.values())

    written, grouped, pending = {}, {}, {}
    before = nans()
    for name, tensor in load_file(stream_file).items():
        group = group_of.get(name)
        if group is None:
            batch = [(name, tensor)]
        else:
            pending[name] = tensor
            if not all(n in pending for n in group):
                continue
            batch = [(n, pending.pop(n)) for n in group]
        model.load_weights(batch)
        after = nans()
        if group is None:
            written[name] = before - after
        else:
            grouped[" + ".join(group)] = before - after
        before = after
    left = {n: int(torch.isnan(p).sum()) for n, p in params.items() if torch.isnan(p).any()}
    with open(out, "w") as f:
        json.dump({"written": written, "groups": grouped, "pending": sorted(pending), "left": left,
                   "parameters": {n: list(p.shape) for n, p in params.items()},
                   "class": type(model).__name__}, f)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("SGLANG_LOG_LEVEL", "error")
    sys.exit(main(sys.argv[1:]))
