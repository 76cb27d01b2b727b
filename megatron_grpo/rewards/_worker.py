"""Entry point of one reward worker process (spawned). Imports nothing heavy: only the function's module.
It dies with the process that started it (parent-death signal), even in the middle of a call.

Protocol on the pipe: worker -> ("ready", None) once the function is resolved, or ("fatal", traceback);
parent -> (task_id, args) or None to exit; worker -> (task_id, ok, result or traceback text).
"""
from __future__ import annotations

import traceback
from multiprocessing.connection import Connection


def worker_main(conn: Connection, spec: str, kwargs: dict, parent_pid: int) -> None:
    from megatron_grpo.launch.lifetime import die_with_parent, ignore_terminal_signals

    die_with_parent(parent_pid)  # before anything that could hang: a killed trainer leaves no worker
    ignore_terminal_signals()  # a Ctrl-C stops the trainer after its step: the calls of that step still count
    from megatron_grpo.rewards.loader import load_reward_function

    try:
        fn = load_reward_function(spec)
    except BaseException:
        conn.send(("fatal", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if message is None:
            return
        task_id, args = message
        try:
            result = fn(*args, **kwargs)
            conn.send((task_id, True, result))
        except BaseException:  # includes an unpicklable result: send() pickles before writing
            conn.send((task_id, False, traceback.format_exc()))
