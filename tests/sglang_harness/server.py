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
    launch_server(server_args, run_scheduler_process_func=run_cpu_scheduler)


if __name__ == "__main__":
    main()
