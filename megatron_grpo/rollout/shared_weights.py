"""HF-named tensor streams into another process on this host, through shared memory.

The local rollout engine running in its own process (rollout/engine_process.py) receives weights
from one or more senders (one per pipeline stage, each in its own trainer process, connected
independently: no hop through global rank 0):

    sender (trainer rank)                                 receiver (engine process)
    SharedWeightSender(endpoint, stage, num_stages)       WeightReceiver(param_shapes)
      push(stream, version):                                one thread per connected sender:
        tensors -> a bucket in shared memory (two            copy the bucket into the "back" staging
        segments, alternating: the next bucket is            buffer (name/shape/dtype checked), ack;
        written while the engine copies the last)            "end" of the last stage of a version:
        "end": the count of tensors; wait for the ack        back <-> front swap, version complete
                                                           take_front(): the newest complete version

Messages go over multiprocessing.connection (an AF_UNIX socket authenticated with a random key);
only metadata travels in them, the bytes stay in /dev/shm. Two staging buffers let a version arrive
while the engine is generating with the previous one and is applied only between generate calls;
a version completed before the previous was applied replaces it (the newest wins).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from multiprocessing.connection import Client, Connection, Listener
from multiprocessing.shared_memory import SharedMemory
from typing import Callable, Iterable

import torch

from megatron_grpo.errors import MegatronGRPOError

log = logging.getLogger(__name__)

NamedTensors = Iterable[tuple[str, torch.Tensor]]
_ALIGN = 64


class WeightStreamError(MegatronGRPOError):
    """A weight push to the engine process failed (refused tensor, lost connection)."""


@dataclass(frozen=True)
class WeightEndpoint:
    """Where senders connect: picklable, broadcast from rank 0 to the stage senders."""

    address: str
    authkey: bytes

    def connect(self) -> Connection:
        return Client(self.address, family="AF_UNIX", authkey=self.authkey)


@dataclass
class PushStats:
    num_tensors: int = 0
    num_bytes: int = 0
    seconds: float = 0.0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightStreamError(f"weight stream: unknown dtype {name!r}")
    return dtype


def _round_up(value: int) -> int:
    return -(-value // _ALIGN) * _ALIGN


def _view(segment: SharedMemory, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    numel = 1
    for size in shape:
        numel *= int(size)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.frombuffer(segment.buf, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(dtype).view(tuple(shape))


class SharedWeightSender:
    """One sender of a stage's tensors (see the module docstring). Not thread-safe: one push at a time."""

    def __init__(self, endpoint: WeightEndpoint, *, stage: int = 0, num_stages: int = 1,
                 bucket_bytes: int = 256 * 2**20, timeout_s: float = 600.0):
        self.endpoint = endpoint
        self.stage, self.num_stages = stage, num_stages
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self._conn: Connection | None = None
        self._segments: list[SharedMemory | None] = [None, None]
        self._unacknowledged: deque[int] = deque()  # segment slots of sent messages, oldest first (-1: "end")

    def _connection(self) -> Connection:
        if self._conn is None:
            try:
                self._conn = self.endpoint.connect()
            except OSError as exc:
                raise WeightStreamError(f"cannot connect to the rollout engine process at {self.endpoint.address} "
                                        f"({exc})") from None
        return self._conn

    def _segment(self, slot: int, nbytes: int) -> SharedMemory:
        segment = self._segments[slot]
        if segment is None or segment.size < nbytes:
            if segment is not None:
                segment.close()
                segment.unlink()
            segment = SharedMemory(create=True, size=max(nbytes, _ALIGN))
            self._segments[slot] = segment
        return segment

    def _await_ack(self, slot: int) -> None:
        """Reads acknowledgements (they come in sending order) until `slot`'s message has one."""
        conn = self._connection()
        while slot in self._unacknowledged:
            try:
                if not conn.poll(self.timeout_s):
                    raise WeightStreamError(f"the rollout engine process did not acknowledge weights within "
                                            f"{self.timeout_s:g}s")
                answer = conn.recv()
            except (EOFError, OSError) as exc:
                raise WeightStreamError(f"the rollout engine process closed the weight connection ({exc!r})") from None
            self._unacknowledged.popleft()
            if answer.get("error"):
                raise WeightStreamError(f"the rollout engine process refused the weights of stage {self.stage}: "
                                        f"{answer['error']}")

    def _send(self, message: dict) -> None:
        try:
            self._connection().send(message)
        except (OSError, EOFError) as exc:
            raise WeightStreamError(f"lost the weight connection to the rollout engine process ({exc!r})") from None

    def push(self, named_tensors: NamedTensors, version: int) -> PushStats:
        """Streams every tensor, then waits until the engine holds all of them (staged)."""
        stats = PushStats()
        start = time.perf_counter()
        try:
            bucket: list[tuple[str, torch.Tensor]] = []
            size, slot = 0, 0
            for name, tensor in named_tensors:
                nbytes = _round_up(tensor.numel() * tensor.element_size())
                if bucket and size + nbytes > self.bucket_bytes:
                    self._flush(bucket, size, slot, version)
                    bucket, size, slot = [], 0, 1 - slot
                bucket.append((name, tensor))
                size += nbytes
                stats.num_tensors += 1
                stats.num_bytes += tensor.numel() * tensor.element_size()
            if bucket:
                self._flush(bucket, size, slot, version)
            self._send({"kind": "end", "version": int(version), "stage": self.stage, "num_stages": self.num_stages,
                        "num_tensors": stats.num_tensors})
            self._unacknowledged.append(-1)
            self._await_ack(-1)
        except BaseException:
            self._reset()  # a half-sent stream: the next push starts on a fresh connection
            raise
        stats.seconds = time.perf_counter() - start
        return stats

    def _flush(self, bucket: list[tuple[str, torch.Tensor]], size: int, slot: int, version: int) -> None:
        self._await_ack(slot)  # the engine has finished reading this segment
        segment = self._segment(slot, size)
        entries, offset = [], 0
        for name, tensor in bucket:
            _view(segment, offset, tensor.dtype, tensor.shape).copy_(tensor.detach())
            entries.append((name, _dtype_name(tensor.dtype), tuple(tensor.shape), offset))
            offset += _round_up(tensor.numel() * tensor.element_size())
        self._send({"kind": "bucket", "version": int(version), "stage": self.stage, "num_stages": self.num_stages,
                    "segment": segment.name, "tensors": entries})
        self._unacknowledged.append(slot)

    def _reset(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._unacknowledged.clear()

    def close(self) -> None:
        self._reset()
        for i, segment in enumerate(self._segments):
            if segment is not None:
                segment.close()
                try:
                    segment.unlink()
                except FileNotFoundError:
                    pass
                self._segments[i] = None


@dataclass
class _Reception:
    version: int
    num_stages: int
    stages_done: set[int] = field(default_factory=set)
    names: set[str] = field(default_factory=set)
    counts: dict[int, int] = field(default_factory=dict)  # tensors received per stage


class WeightReceiver:
    """The engine process's end (see the module docstring). `param_shapes` maps every HF name the
    model accepts to its shape; anything else is refused with a message back to the sender.
    `missing(names)` says which parameters a complete version lacks (the last stage's "end" is
    refused then: stale weights would make the rollout silently off-policy)."""

    def __init__(self, param_shapes: dict[str, tuple[int, ...]], authkey: bytes,
                 missing: Callable[[set[str]], list[str]] = lambda names: []):
        self.param_shapes = param_shapes
        self.missing = missing
        self.listener = Listener(family="AF_UNIX", authkey=authkey)
        self.endpoint = WeightEndpoint(address=self.listener.address, authkey=authkey)
        self._back: dict[str, torch.Tensor] = {}
        self._front: dict[str, torch.Tensor] = {}
        self._front_version: int | None = None
        self._reception: _Reception | None = None
        self._segments: dict[str, SharedMemory] = {}
        self._lock = threading.Lock()
        self._front_lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept_loop, name="weights-accept", daemon=True).start()

    # ----- network side -------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn = self.listener.accept()
            except (OSError, EOFError):  # closed, or a peer that failed authentication
                if self._closed:
                    return
                continue
            threading.Thread(target=self._serve, args=(conn,), name="weights-recv", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    if message["kind"] == "bucket":
                        self._receive_bucket(message)
                    else:
                        self._receive_end(message)
                    answer = {"error": None}
                except Exception as exc:  # noqa: BLE001 - reported to the sender, which raises
                    answer = {"error": f"{type(exc).__name__}: {exc}"}
                try:
                    conn.send(answer)
                except OSError:
                    return

    def _open(self, name: str) -> SharedMemory:
        segment = self._segments.get(name)
        if segment is None:
            segment = SharedMemory(name=name)
            # The sender owns (and unlinks) the segment: this process's resource tracker must not.
            resource_tracker.unregister(segment._name, "shared_memory")  # noqa: SLF001
            self._segments[name] = segment
        return segment

    def _reception_for(self, version: int, num_stages: int) -> _Reception:
        with self._lock:
            current = self._reception
            if current is None or current.version != version:
                if current is not None and current.version > version:
                    raise WeightStreamError(f"weights of version {version} arrived after version {current.version}")
                if current is not None and current.stages_done:
                    log.warning("weight version %d was abandoned incomplete (stages %s of %d)", current.version,
                                sorted(current.stages_done), current.num_stages)
                current = self._reception = _Reception(version, num_stages)
            return current

    def _receive_bucket(self, message: dict) -> None:
        reception = self._reception_for(message["version"], message["num_stages"])
        segment = self._open(message["segment"])
        for name, dtype_name, shape, offset in message["tensors"]:
            expected = self.param_shapes.get(name)
            if expected is None:
                raise WeightStreamError(f"unknown parameter name {name!r} (the engine's model has "
                                        f"{len(self.param_shapes)}, e.g. {sorted(self.param_shapes)[:3]})")
            if tuple(shape) != tuple(expected):
                raise WeightStreamError(f"{name!r} has shape {tuple(shape)}, "
                                        f"the engine's model expects {tuple(expected)}")
            source = _view(segment, offset, _dtype(dtype_name), shape)
            target = self._back.get(name)
            if target is None or target.dtype != source.dtype:
                target = self._back[name] = torch.empty(tuple(shape), dtype=source.dtype)
            target.copy_(source)
            reception.names.add(name)
        stage = int(message["stage"])
        reception.counts[stage] = reception.counts.get(stage, 0) + len(message["tensors"])

    def _receive_end(self, message: dict) -> None:
        reception = self._reception_for(message["version"], message["num_stages"])
        stage = int(message["stage"])
        if reception.counts.get(stage, 0) != message["num_tensors"]:
            raise WeightStreamError(f"stage {stage} sent {message['num_tensors']} tensors of version "
                                    f"{reception.version}, {reception.counts.get(stage, 0)} arrived")
        with self._lock:
            reception.stages_done.add(stage)
            if len(reception.stages_done) < reception.num_stages:
                return
            missing = self.missing(reception.names)
            if missing:
                self._reception = None
                raise WeightStreamError(f"version {reception.version} left {len(missing)} parameters without "
                                        f"weights, e.g. {missing[:5]}")
            with self._front_lock:  # never while the engine copies the front into its model
                self._front, self._back = self._back, self._front
                self._front_version = reception.version
            self._reception = None

    # ----- engine side ----------------------------------------------------------------------
    @property
    def newest_version(self) -> int | None:
        """The newest complete version received (None before the first)."""
        return self._front_version

    def apply_front(self, apply: Callable[[NamedTensors, int], object]) -> int | None:
        """apply(named_tensors, version) with the newest complete version, holding it still."""
        with self._front_lock:
            if self._front_version is None:
                return None
            apply(self._front.items(), self._front_version)
            return self._front_version

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        for segment in self._segments.values():
            segment.close()
        self._segments.clear()
