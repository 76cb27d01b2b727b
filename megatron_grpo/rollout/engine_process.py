"""The local rollout engine in a process of its own: it generates on its own core(s) while the
trainer trains, and takes new weights between generate calls.

    trainer (global rank 0)                              engine process (python -m this module)
    ProcessEngine  --- commands (generate, abort, ---->  LocalEngine on `threads` torch threads
                       health, version) over an           a worker thread runs generate calls in order:
                       authenticated AF_UNIX socket        wait for the weight version asked for, apply
                   <-- samples, timings ---------------    the newest complete one, generate
    stage senders  --- HF-named tensors, shared memory ->  WeightReceiver (rollout/shared_weights.py)
    (one per pipeline stage, any trainer rank)

Samples carry the weight version they were generated with (one version per generate call). A
generate call's requests are reported as each finishes (RequestFinished messages before the call's
answer), so the caller scores them, or stops the call, while the rest generate. The process dies
with the trainer (parent-death signal) and logs to `log_path`.
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Sequence

from megatron_grpo.errors import MegatronGRPOError
from megatron_grpo.rollout.engine import NamedTensors, RequestDone, RolloutEngine, StagedWeightUpdates
from megatron_grpo.rollout.shared_weights import SharedWeightSender, WeightEndpoint
from megatron_grpo.rollout.types import EngineHealth, GenerationRequest, RequestFinished, Sample

log = logging.getLogger(__name__)


class EngineProcessError(MegatronGRPOError):
    """The engine process failed to start, died, or failed a call."""


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process builds: LocalEngine.from_pretrained(model_dir, ...)."""

    model_dir: str
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    max_batch_rows: int = 256
    tokenizer_path: str | None = None
    threads: int = 1  # torch intra-op threads of the engine process
    log_path: str | None = None
    record_routed_experts: bool = True  # a MoE model's routes in each sample (routing replay)
    fp32_lm_head: bool = False  # model.fp32_lm_head: the LM head's matmul in fp32


_CALL_ANSWERED = object()  # ends a generate call's progress queue


@dataclass
class GenerateInfo:
    """What the engine process reports with one generate call's samples."""

    weight_version: int
    apply_weights_s: float  # copying a newly arrived version into the model
    generate_s: float


class ProcessEngine(RolloutEngine, StagedWeightUpdates):
    """The RolloutEngine in another process (see the module docstring). Thread-safe: generate may
    be called from a rollout thread while the trainer's thread evaluates (calls run in order)."""

    def __init__(self, spec: EngineSpec, *, startup_timeout_s: float = 600.0, bucket_bytes: int = 256 * 2**20):
        self.spec = spec
        self.bucket_bytes = bucket_bytes
        authkey = secrets.token_bytes(32)
        listener = Listener(family="AF_UNIX", authkey=authkey)
        log_file = open(spec.log_path, "ab") if spec.log_path else None  # noqa: SIM115 - the child's stdout
        from megatron_grpo.launch.lifetime import preexec_die_with_parent

        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "megatron_grpo.rollout.engine_process"], stdin=subprocess.PIPE,
                stdout=log_file or subprocess.DEVNULL, stderr=subprocess.STDOUT if log_file else None,
                preexec_fn=preexec_die_with_parent(), env=dict(os.environ, OMP_NUM_THREADS=str(spec.threads)))
            self._process.stdin.write(f"{listener.address}\n{authkey.hex()}\n".encode())
            self._process.stdin.close()
            self._conn = self._accept(listener, startup_timeout_s)
        except BaseException:
            self._kill()
            raise
        finally:
            listener.close()
            if log_file is not None:
                log_file.close()
        self._send_lock = threading.Lock()
        self._calls = itertools.count()
        self._pending: dict[int, Future] = {}
        self._progress: dict[int, queue.Queue] = {}  # generate calls: RequestFinished, then _CALL_ANSWERED
        self._dead: str | None = None
        self._conn.send(asdict(spec))
        try:
            hello = self._conn.recv()  # the engine loaded the model: its weight endpoint
        except (EOFError, OSError):
            self._kill()
            raise EngineProcessError(f"the local rollout engine process died while starting{self._see_log()}") from None
        if hello.get("error"):
            self._kill()
            raise EngineProcessError(f"the local rollout engine process failed to start: {hello['error']}")
        self.weight_endpoint = WeightEndpoint(**hello["endpoint"])
        self._version = int(hello["weight_version"])
        self._sender: SharedWeightSender | None = None
        self.last_generate: GenerateInfo | None = None
        self._last_sync: dict[str, float] = {}
        self._reader = threading.Thread(target=self._read_answers, name="engine-process-answers", daemon=True)
        self._reader.start()

    def _accept(self, listener: Listener, timeout_s: float) -> Connection:
        """Waits for the child's connection (or its early death)."""
        result: list = []
        thread = threading.Thread(target=lambda: result.append(listener.accept()), daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while thread.is_alive():
            thread.join(0.1)
            code = self._process.poll()
            if code is not None and thread.is_alive():
                raise EngineProcessError(f"the local rollout engine process exited with code {code} before it "
                                         f"connected{self._see_log()}")
            if time.monotonic() > deadline:
                raise EngineProcessError(f"the local rollout engine process did not start within {timeout_s:g}s"
                                         f"{self._see_log()}")
        return result[0]

    def _see_log(self) -> str:
        return f" (see {self.spec.log_path})" if self.spec.log_path else ""

    # ----- calls ----------------------------------------------------------------------------
    def _read_answers(self) -> None:
        while True:
            try:
                call_id, error, payload = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception as exc:  # noqa: BLE001 - e.g. an answer that does not unpickle: fail the calls, not hang
                log.error("local rollout engine process: unreadable answer (%s: %s)", type(exc).__name__, exc)
                break
            if isinstance(payload, RequestFinished):
                progress = self._progress.get(call_id)
                if progress is not None:
                    progress.put(payload)
                continue
            future = self._pending.pop(call_id, None)
            progress = self._progress.pop(call_id, None)
            if progress is not None:
                progress.put(_CALL_ANSWERED)
            if future is None:
                continue
            if error:
                future.set_exception(EngineProcessError(f"local rollout engine process: {error}"))
            else:
                future.set_result(payload)
        code = self._process.poll()
        self._dead = (f"the local rollout engine process exited (code {code}){self._see_log()}" if code is not None
                      else "the connection to the local rollout engine process was lost")
        for future in list(self._pending.values()):
            future.set_exception(EngineProcessError(self._dead))
        self._pending.clear()
        for progress in list(self._progress.values()):
            progress.put(_CALL_ANSWERED)
        self._progress.clear()

    def _call(self, command: str, *args: Any, timeout_s: float | None = None,
              on_request_done: RequestDone | None = None) -> Any:
        if self._dead:
            raise EngineProcessError(self._dead)
        future: Future = Future()
        call_id = next(self._calls)
        self._pending[call_id] = future
        progress: queue.Queue | None = None
        if on_request_done is not None:
            progress = self._progress[call_id] = queue.Queue()
        try:
            with self._send_lock:
                self._conn.send((call_id, command, args))
        except (OSError, EOFError) as exc:
            self._pending.pop(call_id, None)
            raise EngineProcessError(f"cannot reach the local rollout engine process ({exc!r})") from None
        if self._dead:  # died between the check and the send: the reader may have missed this call
            self._pending.pop(call_id, None)
            self._progress.pop(call_id, None)
            raise EngineProcessError(self._dead)
        # Told on this (the caller's) thread, not the reader's: a callback may call the engine (abort).
        while progress is not None and (item := progress.get()) is not _CALL_ANSWERED:
            on_request_done(item.index, item.samples)
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            raise EngineProcessError(f"local rollout engine process: {command} did not answer within "
                                     f"{timeout_s:g}s") from None

    # ----- RolloutEngine --------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerationRequest],
                 on_request_done: RequestDone | None = None) -> list[Sample]:
        """Samples of `requests`, with the newest weights pushed completely before the call."""
        # the process sends each finished request's samples only when someone listens (a second pickling)
        samples, info = self._call("generate", list(requests), on_request_done is not None,
                                   on_request_done=on_request_done)
        self.last_generate = GenerateInfo(**info)
        return samples

    def abort(self) -> None:
        """Ends the running generate call (its unfinished samples come back as 'abort')."""
        self._call("abort", timeout_s=60.0)

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """All weights from this process as one stage (the per-stage path uses stage senders)."""
        if self._sender is None:
            self._sender = SharedWeightSender(self.weight_endpoint, bucket_bytes=self.bucket_bytes)
        stats = self._sender.push(named_tensors, version)
        self.weights_pushed(version, {"sync/seconds": stats.seconds, "sync/gb": stats.num_bytes / 1e9})

    def weights_pushed(self, version: int, metrics: dict[str, float]) -> None:
        """Every stage's push of `version` was acknowledged (the engine process holds it)."""
        self._version = int(version)
        self._last_sync = dict(metrics)

    # ----- per-stage sync (trainer/sync/stage_sync.py) -------------------------------------------
    def stage_endpoint(self) -> "LocalStageEndpoint":
        return LocalStageEndpoint(self.weight_endpoint)

    def prepare_stage_update(self, version: int) -> None:
        """No engine targets to change: None."""
        return None

    def begin_stage_update(self, version: int) -> None:
        pass  # the process applies a version only once every stage's part of it has arrived

    def end_stage_update(self, version: int, results: list) -> None:
        """results: every sender's (stage, PushStats, weight sample) of a successful push."""
        seconds = max(stats.seconds for _, stats, _ in results)
        nbytes = sum(stats.num_bytes for _, stats, _ in results)
        self.weights_pushed(version, {"sync/seconds": seconds, "sync/gb": nbytes / 1e9,
                                      "sync/stages": float(len(results))})

    def abort_stage_update(self, version: int) -> None:
        pass  # an incomplete version is never applied; the next one replaces it

    def sync_metrics(self) -> dict[str, float]:
        return dict(self._last_sync)

    @property
    def weight_version(self) -> int:
        """The newest version pushed completely (the engine applies it before its next generate)."""
        return self._version

    def release_memory(self) -> None:
        pass  # a process of its own: nothing is shared with the trainer's memory

    def resume_memory(self) -> None:
        pass

    def health(self) -> EngineHealth:
        try:
            detail, version = self._call("health", timeout_s=60.0)
        except EngineProcessError as exc:
            return EngineHealth(False, str(exc), None)
        return EngineHealth(True, detail, version)

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
        if not self._dead:
            try:
                self._call("close", timeout_s=30.0)
            except EngineProcessError:
                pass
        self._kill()

    def _kill(self) -> None:
        process = getattr(self, "_process", None)
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(10.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass(frozen=True)
class LocalStageEndpoint:
    """What a stage sender opens (trainer/sync/stage_sync.py): its own connection into the receiver."""

    endpoint: WeightEndpoint
    push_in_turn = False  # each stage has its own shared-memory channel: all at once

    def open(self, role, bucket_bytes: int) -> SharedWeightSender:
        return SharedWeightSender(self.endpoint, stage=role.stage, num_stages=role.num_stages,
                                  bucket_bytes=bucket_bytes)


# ----- the engine process ------------------------------------------------------------------------
class _EngineServer:
    def __init__(self, conn: Connection, spec: EngineSpec, authkey: bytes):
        import torch

        from megatron_grpo.rollout.local import LocalEngine
        from megatron_grpo.rollout.shared_weights import WeightReceiver

        torch.set_num_threads(spec.threads)
        self.conn = conn
        self.engine = LocalEngine.from_pretrained(spec.model_dir, device=spec.device, dtype=getattr(torch, spec.dtype),
                                                  seed=spec.seed, max_batch_rows=spec.max_batch_rows,
                                                  tokenizer_path=spec.tokenizer_path,
                                                  record_routed_experts=spec.record_routed_experts,
                                                  fp32_lm_head=spec.fp32_lm_head)
        shapes = {name: tuple(param.shape)
                  for name, param in self.engine.model.named_parameters(remove_duplicate=False)}
        self.receiver = WeightReceiver(shapes, authkey, missing=self.engine.parameters_missing_from)
        self.applied: int | None = None  # the receiver version now in the model
        self.send_lock = threading.Lock()
        self.work: queue.Queue = queue.Queue()

    def reply(self, call_id: int, error: str | None, payload: Any = None) -> None:
        with self.send_lock:
            self.conn.send((call_id, error, payload))

    def serve(self) -> None:
        worker = threading.Thread(target=self._work_loop, name="engine-generate", daemon=True)
        worker.start()
        while True:
            try:
                call_id, command, args = self.conn.recv()
            except (EOFError, OSError):
                break
            if command == "generate":
                self.work.put((call_id, args))
            elif command == "abort":
                self.engine.abort()
                self.reply(call_id, None)
            elif command == "health":
                health = self.engine.health()
                self.reply(call_id, None, (health.detail, self.engine.weight_version))
            elif command == "close":
                self.reply(call_id, None)
                break
            else:
                self.reply(call_id, f"unknown command {command!r}")
        self.work.put(None)
        self.receiver.close()

    def _work_loop(self) -> None:
        while (item := self.work.get()) is not None:
            call_id, (requests, report) = item
            try:
                self.reply(call_id, None, self._generate(call_id, requests, report))
            except Exception as exc:  # noqa: BLE001 - reported to the trainer, which raises
                self.reply(call_id, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}")

    def _generate(self, call_id: int, requests, report: bool):
        start = time.perf_counter()
        newest = self.receiver.newest_version
        if newest is not None and newest != self.applied:
            self.applied = self.receiver.apply_front(self.engine.load_weights)
        applied_s = time.perf_counter() - start
        start = time.perf_counter()
        samples = self.engine.generate(
            requests, (lambda index, done: self.reply(call_id, None, RequestFinished(index, done))) if report else None)
        return samples, asdict(GenerateInfo(weight_version=self.engine.weight_version, apply_weights_s=applied_s,
                                            generate_s=time.perf_counter() - start))


def main() -> None:
    from megatron_grpo.launch.lifetime import ignore_terminal_signals

    ignore_terminal_signals()  # the trainer's Ctrl-C / SIGHUP: it finishes its step (it ends us when it exits)
    address = sys.stdin.readline().strip()
    authkey = bytes.fromhex(sys.stdin.readline().strip())
    conn = Client(address, family="AF_UNIX", authkey=authkey)
    spec = EngineSpec(**conn.recv())
    try:
        server = _EngineServer(conn, spec, authkey=secrets.token_bytes(32))
    except Exception as exc:  # noqa: BLE001 - the trainer reports it as one line
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        return
    conn.send({"endpoint": asdict(server.receiver.endpoint), "weight_version": server.engine.weight_version})
    server.serve()


if __name__ == "__main__":
    main()
