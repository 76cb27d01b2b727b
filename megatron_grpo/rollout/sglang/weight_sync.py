"""Weight transports from the trainer to SGLang servers, and the update protocol around them.

Every transport consumes one stream of HF-named full tensors (the exporter's output) in buckets:
- DistributedTransport: a process group of its own (trainer rank 0 + every engine TP rank) built
  to match /init_weights_update_group; per bucket, POST /update_weights_from_distributed with
  names/dtypes/shapes and broadcast the tensors from rank 0. One instance (group name, port) per
  pipeline stage lets the stages push their own layers in parallel. Port 0 (the usual): the store
  binds a port the OS picks, before the engines are told it.
- TensorTransport: per bucket a flattened_bucket payload serialized with ForkingPickler (CUDA IPC
  handles on GPU, shared memory on CPU), one entry per engine TP rank, to
  /update_weights_from_tensor, all made by this process (a multi-rank trainer's colocated engines
  are fed rank by rank instead: rollout/sglang/colocated.py).
- DiskTransport: an HF safetensors folder in a shared directory, then /update_weights_from_disk.

`update_weights` wraps a transport's push in one UpdateSession (rollout/sglang/update_session.py:
pause, begin, push, end, flush, continue); every request carries the weight_version stamp."""
from __future__ import annotations

import abc
import functools
import logging
import shutil
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from megatron_grpo.convert.writer import write_hf_folder
from megatron_grpo.rollout.sglang.buckets import iter_buckets, tensor_bytes
from megatron_grpo.rollout.sglang.client import SGLangClient
from megatron_grpo.rollout.sglang.errors import SGLangError
from megatron_grpo.rollout.sglang.process_group import destroy_process_group, host_store, init_custom_process_group
from megatron_grpo.rollout.sglang.serialization import serialize, tensor_payload
from megatron_grpo.rollout.sglang.update_session import UpdateSession

NamedTensors = Iterable[tuple[str, torch.Tensor]]
log = logging.getLogger(__name__)
JOIN_NOTICE_S = {"first_s": 5.0, "every_s": 30.0}  # when connect() says which engines it waits for


@dataclass
class SyncStats:
    num_tensors: int = 0
    num_bytes: int = 0
    num_buckets: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class EngineTarget:
    """One SGLang server (engine) and how many TP ranks (GPUs) serve it."""

    url: str
    tp_size: int = 1


class WeightTransport(abc.ABC):
    targets: Sequence[EngineTarget]
    # SGLang refuses /update_weights_from_distributed and /update_weights_from_tensor outside a
    # begin/end_weight_update session; /update_weights_from_disk needs none.
    needs_session: bool = True

    @abc.abstractmethod
    def push(self, named_tensors: NamedTensors, version: int) -> SyncStats: ...

    def set_targets(self, targets: Sequence[EngineTarget]) -> None:
        """The engines later pushes go to (after one died or was restarted)."""
        self.targets = list(targets)

    def close(self) -> None:
        pass


def _refused(answer: object) -> bool:
    return isinstance(answer, dict) and answer.get("success") is False


def check_answer(url: str, path: str, answer: object) -> None:
    """Raises SGLangError when an SGLang control call answered {success: false}."""
    if isinstance(answer, dict) and answer.get("success") is False:
        raise SGLangError(f"{url}{path} failed: {answer.get('message')}", url)


class DistributedTransport(WeightTransport):
    """See the module docstring. Call connect() once (it blocks until every engine joined)."""

    def __init__(self, client: SGLangClient, targets: Sequence[EngineTarget], master_address: str, master_port: int,
                 *, group_name: str = "megatron-grpo-weights", backend: str = "nccl", bucket_bytes: int = 512 * 2**20,
                 timeout_s: float = 600.0):
        self.client = client
        self.targets = list(targets)
        # master_port is the port of the group now formed; requested_port what each connect() asks for.
        self.master_address, self.master_port, self.requested_port = master_address, master_port, master_port
        self.group_name, self.backend = group_name, backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.world_size = 1 + sum(t.tp_size for t in self.targets)
        self._group: dist.ProcessGroup | None = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.targets)), thread_name_prefix="weight-sync")

    @classmethod
    def for_pipeline_stage(cls, client: SGLangClient, targets: Sequence[EngineTarget], master_address: str,
                           stage: int, **kwargs) -> "DistributedTransport":
        """The transport of pipeline stage `stage`: a group name of its own, on a port the OS picks."""
        return cls(client, targets, master_address, 0, group_name=f"megatron-grpo-pp{stage}", **kwargs)

    def _post_all(self, path: str, payload_for: Callable[[int, EngineTarget], dict]) -> list[Future]:
        return [self._pool.submit(self.client.call, t.url, path, payload_for(i, t), timeout_s=self.timeout_s)
                for i, t in enumerate(self.targets)]

    def _wait(self, path: str, futures: list[Future]) -> None:
        for target, future in zip(self.targets, futures):
            check_answer(target.url, path, future.result())

    def connect(self) -> None:
        """Hosts the group's store, asks every engine to join, and forms the group. The group forms
        in a helper thread (torch's constructor blocks until every member joined, up to timeout_s)
        while this one watches the engines' answers: an engine whose request fails (nothing
        listens at its URL, it refused) fails the connect at once, naming its URL, and a wait says
        what it waits for after JOIN_NOTICE_S["first_s"] and every JOIN_NOTICE_S["every_s"]. A failed
        join leaves the helper thread blocked until timeout_s (it cannot be stopped; a daemon)."""
        offsets = [1 + sum(t.tp_size for t in self.targets[:i]) for i in range(len(self.targets))]
        store = host_store(self.master_address, self.requested_port, self.world_size, self.timeout_s)
        self.master_port = store.port
        where = f"weight-update group {self.group_name!r} at {self.master_address}:{self.master_port}"
        futures = self._post_all("/init_weights_update_group", lambda i, t: {
            "master_address": self.master_address, "master_port": self.master_port, "rank_offset": offsets[i],
            "world_size": self.world_size, "group_name": self.group_name, "backend": self.backend})
        formed: Future = Future()

        def form() -> None:
            try:
                formed.set_result(init_custom_process_group(self.backend, self.master_address, self.master_port, 0,
                                                            self.world_size, self.group_name,
                                                            timeout_s=self.timeout_s, store=store))
            except BaseException as exc:  # noqa: BLE001 - reported by connect()
                formed.set_exception(exc)

        threading.Thread(target=form, name=f"form-{self.group_name}", daemon=True).start()
        start = time.monotonic()
        next_notice = start + JOIN_NOTICE_S["first_s"]
        while not formed.done():
            for target, future in zip(self.targets, futures):
                if future.done() and (future.exception() is not None or _refused(future.result())):
                    error = future.exception() or future.result().get("message")
                    raise SGLangError(f"{where} cannot form: {target.url}/init_weights_update_group failed ({error}); "
                                      f"that engine will not join, so the trainer does not wait for it "
                                      f"(rollout.sglang.weight_update_timeout_s={self.timeout_s:g})", target.url)
            now = time.monotonic()
            if now >= next_notice:
                waiting = [t.url for t, f in zip(self.targets, futures) if not f.done()]
                ranks = self.world_size - 1
                log.warning("%s: waiting for %s to join (%d engine rank%s); %.0f s waited, gives up after %g s "
                            "(rollout.sglang.weight_update_timeout_s)", where, ", ".join(waiting) or "the engines",
                            ranks, "" if ranks == 1 else "s", now - start, self.timeout_s)
                next_notice = now + JOIN_NOTICE_S["every_s"]
            wait_futures([f for f in (formed, *futures) if not f.done()], timeout=0.1, return_when=FIRST_COMPLETED)
        try:
            self._group = formed.result()
        except Exception as exc:
            failed = [f"{t.url}: {f.exception()}" for t, f in zip(self.targets, futures)
                      if f.done() and f.exception() is not None]
            raise SGLangError(f"{where} did not form ({exc}); engine answers: {failed or 'none yet'}") from None
        self._wait("/init_weights_update_group", futures)

    def push(self, named_tensors: NamedTensors, version: int) -> SyncStats:
        if self._group is None:
            raise SGLangError(f"DistributedTransport {self.group_name!r}: call connect() before push()")
        stats = SyncStats()
        start = time.perf_counter()
        for bucket in iter_buckets(named_tensors, self.bucket_bytes):
            payload = {"names": [n for n, _ in bucket],
                       "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                       "shapes": [list(t.shape) for _, t in bucket], "group_name": self.group_name,
                       "flush_cache": False, "weight_version": str(version)}
            futures = self._post_all("/update_weights_from_distributed", lambda i, t, payload=payload: payload)
            sent = [tensor.detach().to(self.device).contiguous() for _, tensor in bucket]
            works = [dist.broadcast(t, group_src=0, group=self._group, async_op=True) for t in sent]
            self._wait_broadcasts(works, futures)
            stats.num_bytes += sum(tensor_bytes(t) for t in sent)
            self._wait("/update_weights_from_distributed", futures)
            stats.num_tensors += len(bucket)
            stats.num_buckets += 1
        stats.seconds = time.perf_counter() - start
        return stats

    def set_targets(self, targets: Sequence[EngineTarget]) -> None:
        """A new group with these engines: a restarted engine is a new process that never joined
        the old group, and a group cannot shrink. The old one is destroyed first."""
        self.close()
        self.targets = list(targets)
        self.world_size = 1 + sum(t.tp_size for t in self.targets)
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.targets)), thread_name_prefix="weight-sync")
        self.connect()

    def _wait_broadcasts(self, works: list, futures: list[Future]) -> None:
        """Waits for the broadcasts, but fails fast (instead of hanging until the group timeout)
        if an engine already answered the update request with an error."""
        while not all(w.is_completed() for w in works):
            for target, future in zip(self.targets, futures):
                if future.done() and (future.exception() is not None or
                                      (isinstance(future.result(), dict) and future.result().get("success") is False)):
                    error = future.exception() or future.result().get("message")
                    raise SGLangError(f"{target.url}/update_weights_from_distributed failed while the trainer was "
                                      f"broadcasting (group {self.group_name!r} is now unusable): {error}", target.url)
            time.sleep(0.0005)
        for work in works:
            work.wait()

    def close(self) -> None:
        if self._group is not None:
            futures = self._post_all("/destroy_weights_update_group", lambda i, t: {"group_name": self.group_name})
            for future in futures:
                future.exception()  # best effort: a server that is gone has no group left anyway
            destroy_process_group(self._group)
            self._group = None
        self._pool.shutdown(wait=False)


class TensorTransport(WeightTransport):
    """Tensors stay in this process's memory and the servers map them (see the module docstring):
    every payload is made here and replicated to every TP rank of every engine. Right for one
    process feeding engines on its node (weight_sync_route=rank0, tools, benchmarks); a multi-rank
    trainer feeds each colocated engine rank from the trainer rank on its GPU instead
    (rollout/sglang/colocated.py). `flattened=None` sends SGLang's flattened_bucket when sglang
    imports here, else a plain (name, tensor) list."""

    def __init__(self, client: SGLangClient, targets: Sequence[EngineTarget], *, bucket_bytes: int = 512 * 2**20,
                 flattened: bool | None = None, timeout_s: float = 600.0):
        self.client = client
        self.targets = list(targets)
        self.bucket_bytes = bucket_bytes
        self.flattened = flattened
        self.timeout_s = timeout_s

    def push(self, named_tensors: NamedTensors, version: int) -> SyncStats:
        def post(serialized: Callable[[], str], load_format: str | None) -> None:
            for target in self.targets:  # one pickling per receiving TP rank (push_tensor_buckets)
                answer = self.client.call(target.url, "/update_weights_from_tensor", tensor_update_request(
                    [serialized() for _ in range(target.tp_size)], load_format, version), timeout_s=self.timeout_s)
                check_answer(target.url, "/update_weights_from_tensor", answer)

        return push_tensor_buckets(named_tensors, self.bucket_bytes, self.flattened, post)


def tensor_update_request(payloads: list[str], load_format: str | None, version: int) -> dict:
    """The body of /update_weights_from_tensor (UpdateWeightsFromTensorReqInput): one serialized
    payload per engine TP rank."""
    return {"serialized_named_tensors": payloads, "load_format": load_format, "flush_cache": False,
            "weight_version": str(version)}


def push_tensor_buckets(named_tensors: NamedTensors, bucket_bytes: int, flattened: bool | None,
                        post: Callable[[Callable[[], str], str | None], None]) -> SyncStats:
    """The tensor route's loop: per bucket `post(serialized, load_format)`, where each call of
    `serialized()` pickles the payload afresh for ONE receiving process: torch counts the receivers
    of CPU shared memory per pickling ("file_system": a pickling adds a reference that one
    unpickling takes back), so one pickle read by a third process found the memory unlinked. SGLang's
    own Engine API pickles once per TP rank too, on GPUs as well. The bucket's tensors stay alive
    until `post` returns (the server maps them)."""
    stats = SyncStats()
    start = time.perf_counter()
    for bucket in iter_buckets(named_tensors, bucket_bytes):
        payload = tensor_payload(bucket, flattened)
        post(functools.partial(serialize, payload.obj), payload.load_format)
        del payload
        stats.num_tensors += len(bucket)
        stats.num_bytes += sum(tensor_bytes(t) for _, t in bucket)
        stats.num_buckets += 1
    stats.seconds = time.perf_counter() - start
    return stats


class DiskTransport(WeightTransport):
    """Writes `folder/weights_v{version}` (shared with the servers), then every server reloads it.
    Keeps the newest `keep_last` folders; config/tokenizer files come from `side_files_from`."""

    needs_session = False

    def __init__(self, client: SGLangClient, targets: Sequence[EngineTarget], folder: str | Path, *,
                 side_files_from: str | Path | None = None, keep_last: int = 1, max_shard_bytes: int = 2 * 1024**3,
                 timeout_s: float = 1800.0):
        self.client = client
        self.targets = list(targets)
        self.folder = Path(folder)
        self.side_files_from = side_files_from
        self.keep_last = keep_last
        self.max_shard_bytes = max_shard_bytes
        self.timeout_s = timeout_s

    def push(self, named_tensors: NamedTensors, version: int) -> SyncStats:
        start = time.perf_counter()
        tensors = []

        def counted():
            for name, tensor in named_tensors:
                tensors.append(tensor_bytes(tensor))
                yield name, tensor

        path, nbytes = write_hf_folder(counted(), self.folder / f"weights_v{version}",
                                       side_files_from=self.side_files_from, max_shard_bytes=self.max_shard_bytes)
        answers = self.client.call_all("/update_weights_from_disk", {
            "model_path": str(path), "weight_version": str(version), "flush_cache": False},
            urls=[t.url for t in self.targets], timeout_s=self.timeout_s)
        for target, answer in zip(self.targets, answers):
            check_answer(target.url, "/update_weights_from_disk", answer)
        self._prune(keep=path)
        return SyncStats(len(tensors), nbytes, 1, time.perf_counter() - start)

    def _prune(self, keep: Path) -> None:
        folders = sorted((p for p in self.folder.glob("weights_v*") if p.is_dir() and p != keep),
                         key=lambda p: p.stat().st_mtime)
        for old in folders[:max(0, len(folders) - (self.keep_last - 1))]:
            shutil.rmtree(old, ignore_errors=True)


def update_weights(client: SGLangClient, transport: WeightTransport, named_tensors: NamedTensors,
                   version: int) -> SyncStats:
    """One update of every engine behind `transport` (rollout/sglang/update_session.py)."""
    with UpdateSession(client, [t.url for t in transport.targets], needs_session=transport.needs_session):
        return transport.push(named_tensors, version)
