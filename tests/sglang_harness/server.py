"""`python -m tests.sglang_harness.server [sglang.launch_server flags]`: SGLang's real server with
the CPU scheduler (see __init__.py). Flags are parsed by SGLang's own `prepare_server_args`;
`--device cpu` is implied."""
from __future__ import annotations

import os
import sys

from tests.sglang_harness import torchvision_stub

torchvision_stub.install()


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
    # SGLang on CPU binds each TP rank to its own cores (one NUMA node per rank unless told);
    # the test machines have one node, so give each rank one core.
    os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND",
                          "|".join(str(rank % (os.cpu_count() or 1)) for rank in range(server_args.tp_size)))
    launch_server(server_args, run_scheduler_process_func=run_cpu_scheduler)


if __name__ == "__main__":
    main()
