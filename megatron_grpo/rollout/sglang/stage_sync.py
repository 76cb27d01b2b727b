"""Per-stage weight sync into SGLang servers (trainer/sync/stage_sync.py): each pipeline stage's sender
opens a DistributedTransport of its own (group megatron-grpo-pp<stage>, its store on a port the
OS picks on the sender's host), joined by every TP rank of every engine.

SGLang 0.5.23 keeps its weight-update groups in a dict keyed by group name, so the stages' groups
coexist, and /update_weights_from_distributed names the group it receives from. Its tokenizer
manager runs the updates of one engine one at a time (a FIFO "queueing" communicator), so the
stages' buckets reach one engine interleaved, each broadcast over its own group: with one engine
the stages push at the same time. With several engines the FIFO orders of two engines can differ
(engine 1 serves stage 0's request first, engine 2 stage 1's), and an engine's scheduler blocked
in one group (joining it, or receiving a broadcast) waits for an engine blocked in the other: the
stages then open, rebuild and push their groups in turn (push_in_turn; StageSync.stage_by_stage).
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Sequence

from megatron_grpo.rollout.sglang.client import SGLangClient
from megatron_grpo.rollout.sglang.http_json import RetryPolicy
from megatron_grpo.rollout.sglang.weight_sync import DistributedTransport, EngineTarget


@dataclass(frozen=True)
class SGLangStageEndpoint:
    """Picklable: what a stage sender needs to reach the engines (made by rank 0's SGLangEngine)."""

    targets: tuple[EngineTarget, ...]
    rank0_host: str  # rank 0's hostname: a sender on that host uses rank0_address
    rank0_address: str  # the address the engines reach rank 0's host at (MASTER_ADDR)
    backend: str
    timeout_s: float
    api_key: str | None
    request_timeout_s: float
    max_attempts: int
    push_in_turn: bool  # several engines: one stage after another (module docstring)

    def open(self, role, bucket_bytes: int) -> "SGLangStageSink":
        """Connects stage `role.stage`'s group (blocks until every engine TP rank joined it)."""
        address = self.rank0_address if socket.gethostname() == self.rank0_host else socket.getfqdn()
        client = SGLangClient([t.url for t in self.targets], timeout_s=self.request_timeout_s,
                              retry=RetryPolicy(max_attempts=self.max_attempts), api_key=self.api_key)
        transport = DistributedTransport.for_pipeline_stage(client, self.targets, address, role.stage,
                                                            backend=self.backend, bucket_bytes=bucket_bytes,
                                                            timeout_s=self.timeout_s)
        try:
            transport.connect()
        except BaseException:
            transport.close()
            client.close()
            raise
        return SGLangStageSink(client, transport)


class SGLangStageSink:
    """A stage sender's DistributedTransport; set_targets rebuilds its group (on a new port)."""

    def __init__(self, client: SGLangClient, transport: DistributedTransport):
        self.client, self.transport = client, transport

    def push(self, named_tensors, version: int):
        return self.transport.push(named_tensors, version)

    def set_targets(self, targets: Sequence[EngineTarget]) -> None:
        self.client.set_urls([t.url for t in targets])
        self.transport.set_targets(targets)

    def close(self) -> None:
        self.transport.close()
        self.client.close()
