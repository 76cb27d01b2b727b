"""`python -m tests.sglang_harness.server [sglang.launch_server flags]`: SGLang's real server with
the CPU scheduler (see __init__.py). Flags are parsed by SGLang's own `prepare_server_args`;
`--device cpu` is implied."""
from __future__ import annotations

import os
import sys

from tests.sglang_harness import memory_saver_stub, torchvision_stub

torchvision_stub.install()
memory_saver_stub.install()  # before sglang is imported: --enable-memory-saver


def main(argv: list[str] | None = None) -> None:
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.server_args import prepare_server_args

    from tests.sglang_harness.scheduler import run_cpu_scheduler

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--device" not in argv:
        argv += ["--device", "cpu"]
    if "--enable-deterministic-inference" in argv and "--attention-backend" not in argv:
        # SGLang accepts deterministic inference only with GPU attention backends (its CPU default,
        # intel_amx, is refused). The CPU scheduler runs no attention kernel, so name a GPU one.
        argv += ["--attention-backend", "triton"]
    server_args = prepare_server_args(argv)
    # SGLang on CPU binds each TP rank to its own cores: entry gpu_id of this list, where gpu_id =
    # base_gpu_id + rank * gpu_id_step (an emulated device: colocated tests give engines other
    # base GPUs). The test machines have one NUMA node, so each entry is one core.
    devices = server_args.base_gpu_id + server_args.tp_size * server_args.gpu_id_step
    os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND",
                          "|".join(str(device % (os.cpu_count() or 1)) for device in range(devices)))
    _fork_instead_of_spawn()
    launch_server(server_args, run_scheduler_process_func=run_cpu_scheduler)


def _fork_instead_of_spawn() -> None:
    """SGLang forces the 'spawn' start method (CUDA cannot be forked); the CPU stand-in forks its
    scheduler and detokenizer processes instead. They run the same code with the same arguments,
    but inherit the server's imports: spawned, each re-imported SGLang (~5 s of CPU per process,
    most of a harness server's start on the tests' 2 cores)."""
    import multiprocessing

    set_start_method = multiprocessing.set_start_method

    def forked(method: str | None, force: bool = False) -> None:
        set_start_method("fork" if method == "spawn" else method, force=force)

    multiprocessing.set_start_method = forked


if __name__ == "__main__":
    main()
