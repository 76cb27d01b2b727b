"""Start fake SGLang servers as subprocesses through the real launcher (for tests and benchmarks)."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Sequence

from megatron_grpo.rollout.sglang.launcher import ServerSettings, SGLangLauncher
from megatron_grpo.testing.distributed import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


def fake_server_settings(model_dir: str | Path, tp_size: int = 1, extra_args: Sequence[str] = (),
                         api_key: str | None = None) -> ServerSettings:
    return ServerSettings(model_path=str(model_dir), tp_size=tp_size, port=free_port(), api_key=api_key,
                          mem_fraction_static=0.5, extra_args=tuple(extra_args), python=sys.executable,
                          module="tests.fake_sglang.server")


def launch_fake_servers(log_dir: str | Path, settings: Sequence[ServerSettings], timeout_s: float = 120.0
                        ) -> SGLangLauncher:
    """Starts the servers and waits for /health; the caller shuts them down (launcher.shutdown())."""
    env = {"PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    launcher = SGLangLauncher(servers=list(settings), log_dir=log_dir, env=env)
    launcher.start()
    try:
        launcher.wait_healthy(timeout_s=timeout_s, poll_s=0.2)
    except BaseException:
        launcher.shutdown(grace_s=2)
        raise
    return launcher
