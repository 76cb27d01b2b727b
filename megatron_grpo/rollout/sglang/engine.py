"""SGLangEngine: the RolloutEngine over SGLang servers (generation via the client, weights via a transport)."""
from __future__ import annotations

from typing import Sequence

from megatron_grpo.rollout.engine import NamedTensors, RolloutEngine
from megatron_grpo.rollout.sglang.client import SGLangClient
from megatron_grpo.rollout.sglang.errors import SGLangError
from megatron_grpo.rollout.sglang.protocol import parse_weight_version
from megatron_grpo.rollout.sglang.weight_sync import SyncStats, WeightTransport, update_weights
from megatron_grpo.rollout.types import EngineHealth, GenerationRequest, Sample


class SGLangEngine(RolloutEngine):
    """`client` talks to the engines (or to a router for /generate: pass `generate_client`);
    weight updates and memory calls always go to each engine directly."""

    def __init__(self, client: SGLangClient, transport: WeightTransport, *,
                 generate_client: SGLangClient | None = None, memory_tags: Sequence[str] | None = None):
        self.client = client
        self.transport = transport
        self.generate_client = generate_client or client
        self.memory_tags = list(memory_tags) if memory_tags else None
        self._version = 0
        self._released = False
        self.last_sync: SyncStats | None = None

    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Sample]:
        return self.generate_client.generate(requests)

    def abort(self) -> None:
        self.generate_client.abort()

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        # Colocated wake-up in two stages: weight memory before the push, KV cache after it, so
        # the trainer's buffers and the KV cache never need GPU memory at the same time.
        if self._released:
            self.client.call_all("/resume_memory_occupation", {"tags": ["weights"]})
        self.last_sync = update_weights(self.client, self.transport, named_tensors, version)
        self._version = int(version)
        if self._released:
            self.resume_memory()

    def release_memory(self) -> None:
        self.client.call_all("/release_memory_occupation", {"tags": self.memory_tags})
        self._released = True

    def resume_memory(self) -> None:
        self.client.call_all("/resume_memory_occupation", {"tags": self.memory_tags})
        self._released = False

    def health(self) -> EngineHealth:
        problems, versions = [], set()
        for url in self.client.urls:
            try:
                self.client.call(url, "/health_generate", method="GET", timeout_s=60.0)
                info = self.client.call(url, "/model_info", method="GET", timeout_s=30.0)
                versions.add(parse_weight_version(info.get("weight_version"), f"{url}/model_info"))
            except SGLangError as exc:
                problems.append(str(exc))
        if len(versions) > 1:
            problems.append(f"servers disagree on weight_version: {sorted(versions)}")
        detail = "; ".join(problems) or f"{len(self.client.urls)} SGLang servers healthy"
        return EngineHealth(not problems, detail, versions.pop() if len(versions) == 1 else None)

    def close(self) -> None:
        self.transport.close()
        self.client.close()
        if self.generate_client is not self.client:
            self.generate_client.close()
