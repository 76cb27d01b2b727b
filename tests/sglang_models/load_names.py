"""Run with SGLang's interpreter (build/sglang-venv): feeds an HF-named weight stream to SGLang
0.5.23's OWN model class for the checkpoint's architecture and reports what its `load_weights`
did with each name. SGLang renames, stacks (q/k/v, gate/up, per-expert -> FusedMoE w13/w2) and
silently skips names it does not know; this reports it from SGLang's code, not from a list of ours.

    python -m tests.sglang_models.load_names MODEL_DIR STREAM.safetensors OUT.json

The model is built on CPU at TP 1 in one process (SGLang's own parallel groups over gloo); every
parameter is filled with NaN first; the stream is fed one tensor per load_weights call, and a
tensor counts as loaded when exactly tensor.numel() NaN elements of the model were overwritten by
it. Out: {"written": {name: elements overwritten}, "left": {parameter: NaN elements left},
"parameters": {parameter: shape}}. Nothing SGLang runs here computes: the rotary kernel import that
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
    import importlib

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
    module = importlib.import_module(f"sglang.srt.models.{config.model_type}")
    entries = module.EntryClass if isinstance(module.EntryClass, list) else [module.EntryClass]
    (cls,) = [c for c in entries if c.__name__ == config.architectures[0]]
    torch.set_default_dtype(torch.float32)
    return cls(config)


def main(argv) -> int:
    model_dir, stream_file, out = argv
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

    written = {}
    before = nans()
    for name, tensor in load_file(stream_file).items():
        model.load_weights([(name, tensor)])
        after = nans()
        written[name] = before - after
        before = after
    left = {n: int(torch.isnan(p).sum()) for n, p in params.items() if torch.isnan(p).any()}
    with open(out, "w") as f:
        json.dump({"written": written, "left": left, "parameters": {n: list(p.shape) for n, p in params.items()},
                   "class": type(model).__name__}, f)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("SGLANG_LOG_LEVEL", "error")
    sys.exit(main(sys.argv[1:]))
