"""`python -m megatron_grpo.launch.api_key_exec VARIABLE MODULE [ARGS ...]` runs
`python -m MODULE ARGS ... --api-key <the value of $VARIABLE>` in this process, so that the key
never appears on a command line (`ps` shows every user's). SGLang's server and sglang-router take
their key only as `--api-key` (neither reads one from the environment); both parse sys.argv, which
is this process's own, while /proc/PID/cmdline keeps what was executed. The variable is removed
from the environment before the module runs, so the processes it starts do not inherit it."""
from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: python -m megatron_grpo.launch.api_key_exec VARIABLE MODULE [ARGS ...]")
    variable, module, *args = argv
    key = os.environ.pop(variable, "")
    if not key:
        print(f"error: {variable} is not set: it holds the API key for {module} (--api-key)", file=sys.stderr)
        sys.exit(2)
    if "--api-key" in args:
        print(f"error: {module} got --api-key on its command line as well as from {variable}", file=sys.stderr)
        sys.exit(2)
    sys.argv = [module, *args, "--api-key", key]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
