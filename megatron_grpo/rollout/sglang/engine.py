"""SGLangEngine: the RolloutEngine over SGLang servers (generation via the client, weights via a
transport, engine health via the pool)."""
from __future__ import annotations

import dataclasses
import logging
import socket
import time
from typing import Sequence

from megatron_grpo.rollout.engine import ColocatedWeightUpdates, NamedTensors, RequestDone, RolloutEngine
from megatron_grpo.rollout.sglang.client import SGLangClient
from megatron_grpo.rollout.sglang.errors import SGLangError
from megatron_grpo.rollout.sglang.http_json import RetryPolicy
from megatron_grpo.rollout.sglang.pool import EnginePool, EngineSlot, HealthProber
from megatron_grpo.rollout.sglang.protocol import parse_weight_version
from megatron_grpo.rollout.sglang.verify import ChecksumPlan, WeightSample, verify_engines
from megatron_grpo.rollout.sglang.update_session import UpdateSession
from megatron_grpo.rollout.sglang.weight_sync import (DistributedTransport, SyncStats, TensorTransport, WeightTransport,
                                                      update_weights)
from megatron_grpo.rollout.types import EngineHealth, GenerationRequest, Sample

log = logging.getLogger(__name__)

# SGLang's memory tags (sglang.srt.constants); releasing all of them frees the whole GPU.
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    send_seeds: bool = True  # False: unseeded requests (seeds do nothing without deterministic inference)
    verify_interval: int = 50  # verify every N-th sync (and the first); 0 = never
    health_check_interval_s: float = 30.0  # background /health_generate probe; 0 = off
    health_check_timeout_s: float = 60.0
    min_engines: int = 1
    # Routing replay (actor.moe_routing_replay): (num_hidden_layers, num_experts_per_tok) of the MoE
    # model; every request asks for SGLang's return_routed_experts (the servers need
    # --enable-return-routed-experts) and each sample carries its routes. None: not asked.
    routed_experts_shape: tuple[int, int] | None = None
    # Asynchronous GRPO: a weight update aborts the requests in flight (pause_generation mode=abort);
    # True resubmits their groups, which SGLang holds until generation continues, so they come back
    # whole from the new weights (the partial work is lost). False returns them as 'abort' samples.
    resubmit_aborted: bool = False
    max_resubmits: int = 8  # per generate call: a group aborted this often is returned as aborted
    # The served model (models.hf_config.ModelArchitecture): verification predicts from it what SGLang's
    # /weights_checker must report (verify.py ChecksumPlan); None: the engines are compared with each other.
    model: object = None


def _when_whole(on_request_done: RequestDone | None, indices: Sequence[int]) -> RequestDone | None:
    """on_request_done for requests that came back with no aborted sample; the call's j-th request
    is the caller's indices[j]."""
    if on_request_done is None:
        return None

    def done(j: int, samples: list[Sample]) -> None:
        if not any(s.finish_reason == "abort" for s in samples):
            on_request_done(indices[j], samples)
    return done


class SGLangEngine(RolloutEngine, ColocatedWeightUpdates):
    """`client` talks to the engines; `generate_client` (a router, if any) only serves /generate.
    Weight updates, memory and control calls (abort, pause, flush) always go to each engine
    directly: a router has no such routes."""

    def __init__(self, client: SGLangClient, transport: WeightTransport, *,
                 generate_client: SGLangClient | None = None, pool: EnginePool | None = None,
                 options: EngineOptions = EngineOptions(), launcher=None):
        self.client = client
        self.transport = transport
        self.launcher = launcher  # servers launched for this engine (rollout/sglang/launcher.py): stopped on close
        self.generate_client = generate_client or client
        self.options = options
        self.pool = pool or EnginePool([EngineSlot(t) for t in transport.targets], min_engines=options.min_engines,
                                       probe_timeout_s=options.health_check_timeout_s, api_key=client.api_key)
        self.pool.on_change = self._rotation_changed
        self._version = 0
        self._syncs = 0
        self._released: set[str] = set()  # SGLang raises (and dies) on resuming a tag it has not released
        self._push_failed = False
        self.prober = HealthProber(self.pool, options.health_check_interval_s,
                                   enabled=lambda: not self._released).start()
        self.last_sync: SyncStats | None = None
        self.last_sync_metrics: dict[str, float] = {}
        self._stage_targets = list(self.pool.alive_targets)  # per-stage sync: what the senders reach
        self._stage_started = 0.0
        self._session: UpdateSession | None = None  # the open update of the staged protocol
        self._stopping = False  # abort() was called during the current generate
        self.resubmitted_groups = 0  # groups resubmitted after a weight update aborted them (resubmit_aborted)
        self.checks = ChecksumPlan(client, options.model)

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def urls(self) -> list[str]:
        return [t.url for t in self.pool.alive_targets]

    def generate(self, requests: Sequence[GenerationRequest],
                 on_request_done: RequestDone | None = None) -> list[Sample]:
        if not self.options.send_seeds:
            requests = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, seed=None)) for r in requests]
        if self.options.routed_experts_shape is not None:
            requests = [dataclasses.replace(r, routed_experts_shape=self.options.routed_experts_shape)
                        for r in requests]
        self._stopping = False
        if not self.options.resubmit_aborted:
            return self.generate_client.generate(requests, on_request_done)
        # A request a weight update aborted is resubmitted: it is done when it comes back whole.
        samples = self.generate_client.generate(requests, _when_whole(on_request_done, range(len(requests))))
        # samples come back in request order, n per request: a request's are samples[start:start + n]
        # (matched by position, not group id: requests may share one, e.g. an episode's turns)
        starts = [0]
        for r in requests:
            starts.append(starts[-1] + r.sampling.n)
        for _ in range(self.options.max_resubmits):
            again = [i for i, r in enumerate(requests)
                     if any(s.finish_reason == "abort" for s in samples[starts[i]:starts[i + 1]])]
            if not again or self._stopping:  # abort() asked for them: they stay aborted
                break
            log.info("resubmitting %d request(s) aborted by a weight update", len(again))
            self.resubmitted_groups += len({requests[i].group_id for i in again})
            fresh = self.generate_client.generate([requests[i] for i in again], _when_whole(on_request_done, again))
            samples = list(samples)
            offset = 0
            for i in again:
                n = requests[i].sampling.n
                samples[starts[i]:starts[i + 1]] = fresh[offset:offset + n]
                offset += n
        if on_request_done is not None:  # what stays aborted is final too
            for i in range(len(requests)):
                if any(s.finish_reason == "abort" for s in samples[starts[i]:starts[i + 1]]):
                    on_request_done(i, samples[starts[i]:starts[i + 1]])
        return samples

    def abort(self) -> None:
        self._stopping = True
        self.generate_client.stop_generating()
        self.client.call_all("/abort_request", {"abort_all": True}, urls=self.urls,
                             retry=RetryPolicy(max_attempts=1))

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        with self.prober.paused():
            restarted = self.pool.recover()
            alive = self.pool.alive_targets
            if restarted or self._push_failed or alive != list(self.transport.targets):
                self.transport.set_targets(alive)  # (a distributed group is rebuilt)
                self._push_failed = False
            # Colocated wake-up in two stages: weight memory before the push, the rest after it, so
            # the trainer's buffers and the KV cache never need GPU memory at the same time.
            if "weights" in self._released:
                self._resume(["weights"])
            verify = self._verification_due()
            sample = self.checks.sample(alive) if verify else None
            stream = sample.tap(named_tensors) if sample else named_tensors
            try:
                self.last_sync = update_weights(self.client, self.transport, stream, version)
            except SGLangError:
                self._push_failed = True  # e.g. an engine died mid-broadcast: its group is unusable
                raise
            self._version = int(version)
            self._syncs += 1
            if self._released:
                self._resume(sorted(self._released))
            self.last_sync_metrics = {"sync/seconds": self.last_sync.seconds,
                                      "sync/gb": self.last_sync.num_bytes / 1e9,
                                      "sync/engine_restarts": float(self.pool.restarts)}
            if sample is not None:
                self.last_sync_metrics.update(verify_engines(self.client, alive, sample, self.checks).metrics())

    def sync_metrics(self) -> dict[str, float]:
        return dict(self.last_sync_metrics)

    # ----- sync from sender ranks (trainer/sync/stage_sync.py: per stage, rollout/sglang/stage_sync.py;
    # colocated, rollout/sglang/colocated.py) ---------------------------------------------------
    # One update: prepare (recover engines; new targets -> the senders rebuild their groups), begin
    # (pause generation, ONE begin_weight_update session per engine), the senders push, end (end
    # the sessions, flush, continue, verify) or abort. The health prober stays paused in between.
    def stage_endpoint(self):
        from megatron_grpo.rollout.sglang.stage_sync import SGLangStageEndpoint

        if not isinstance(self.transport, DistributedTransport):
            raise SGLangError("per-stage weight sync needs rollout.sglang.weight_sync=distributed (each stage's "
                              f"sender broadcasts to the engines); this engine has {type(self.transport).__name__}")
        t = self.transport
        self._stage_targets = list(self.pool.alive_targets)
        return SGLangStageEndpoint(
            targets=tuple(self._stage_targets), rank0_host=socket.gethostname(), rank0_address=t.master_address,
            backend=t.backend, timeout_s=t.timeout_s, api_key=self.client.api_key,
            request_timeout_s=self.client.timeout_s, max_attempts=self.client.retry.max_attempts,
            push_in_turn=len(self.pool.slots) > 1)

    def colocated_endpoint(self):
        """What each trainer rank feeding a colocated engine needs (rollout/sglang/colocated.py):
        every engine in placement order, dead or alive (the order fixes which GPU feeds which)."""
        from megatron_grpo.rollout.sglang.colocated import SGLangColocatedEndpoint

        if not isinstance(self.transport, TensorTransport):
            raise SGLangError("colocated weight sync needs rollout.sglang.weight_sync=tensor; this engine has "
                              f"{type(self.transport).__name__}")
        self._stage_targets = list(self.pool.alive_targets)
        return SGLangColocatedEndpoint(
            targets=tuple(slot.target for slot in self.pool.slots), api_key=self.client.api_key,
            request_timeout_s=self.client.timeout_s, timeout_s=self.transport.timeout_s,
            max_attempts=self.client.retry.max_attempts)

    def prepare_stage_update(self, version: int):
        """The engines the senders must now reach, or None when they are unchanged."""
        self.prober.pause()
        try:
            restarted = self.pool.recover()
            alive = self.pool.alive_targets
            if "weights" in self._released:
                self._resume(["weights"])
        except BaseException:
            self.prober.resume()
            raise
        if not (restarted or self._push_failed or alive != self._stage_targets):
            return None
        self._stage_targets, self._push_failed = list(alive), False
        return list(alive)

    def begin_stage_update(self, version: int) -> WeightSample | None:
        """Pauses generation and opens the sessions; returns the weight sample the senders fill
        (when verification is due)."""
        self._session = UpdateSession(self.client, [t.url for t in self._stage_targets])
        try:
            self._session.open()
        except BaseException:
            self._push_failed = True
            self.prober.resume()
            raise
        self._stage_started = time.perf_counter()
        verify = self._verification_due()
        return self.checks.sample(self._stage_targets) if verify else None

    def end_stage_update(self, version: int, results: list) -> None:
        """results: every sender's (stage, SyncStats, its filled WeightSample or None) of a successful push."""
        alive = list(self._stage_targets)
        session, self._session = self._session, None
        try:
            session.close()
        except BaseException:
            self._push_failed = True
            self.prober.resume()
            raise
        try:
            self._version = int(version)
            self._syncs += 1
            if self._released:
                self._resume(sorted(self._released))
            stats = [s for _, s, _ in results]
            self.last_sync = SyncStats(num_tensors=sum(s.num_tensors for s in stats),
                                       num_bytes=sum(s.num_bytes for s in stats),
                                       num_buckets=sum(s.num_buckets for s in stats),
                                       seconds=time.perf_counter() - self._stage_started)
            self.last_sync_metrics = {"sync/seconds": self.last_sync.seconds,
                                      "sync/gb": self.last_sync.num_bytes / 1e9,
                                      "sync/stages": float(len(results)),
                                      "sync/engine_restarts": float(self.pool.restarts)}
            samples = [sample for _, _, sample in results if sample is not None]
            if samples:
                sample = samples[0]
                for other in samples[1:]:
                    sample.merge(other)
                self.last_sync_metrics.update(verify_engines(self.client, alive, sample, self.checks).metrics())
        finally:
            self.prober.resume()

    def abort_stage_update(self, version: int) -> None:
        """A sender's push (or a group rebuild before the session opened) failed: its group is
        unusable, the next prepare rebuilds every group."""
        self._push_failed = True
        session, self._session = self._session, None
        try:
            (session or UpdateSession(self.client, [t.url for t in self._stage_targets])).abort()
        finally:
            self.prober.resume()

    def _verification_due(self) -> bool:
        interval = self.options.verify_interval
        return interval > 0 and (self._syncs == 0 or (self._syncs + 1) % interval == 0)

    def release_memory(self) -> None:
        self.client.call_all("/release_memory_occupation", {"tags": list(MEMORY_TAGS)}, urls=self.urls)
        self._released = set(MEMORY_TAGS)

    def resume_memory(self) -> None:
        if self._released:
            self._resume(sorted(self._released))

    def _resume(self, tags: list[str]) -> None:
        self.client.call_all("/resume_memory_occupation", {"tags": tags}, urls=self.urls)
        self._released -= set(tags)

    def _rotation_changed(self, alive) -> None:
        urls = [t.url for t in alive]
        self.client.set_urls(urls)
        if self.generate_client is not self.client:
            if len(self.generate_client.urls) > 1:
                self.generate_client.set_urls(urls)  # a separate client of engines
            else:  # a router keeps its own list; what it may hold in flight follows the live engines
                self.generate_client.set_engines_per_url(len(urls))

    def health(self) -> EngineHealth:
        problems, versions = [], set()
        for url in self.urls:
            try:
                self.client.call(url, "/health_generate", method="GET", timeout_s=self.options.health_check_timeout_s)
                info = self.client.call(url, "/model_info", method="GET", timeout_s=30.0)
                versions.add(parse_weight_version(info.get("weight_version"), f"{url}/model_info"))
            except SGLangError as exc:
                problems.append(str(exc))
        if len(versions) > 1:
            problems.append(f"servers disagree on weight_version: {sorted(versions)}")
        detail = "; ".join(problems) or f"{len(self.urls)} SGLang servers healthy"
        return EngineHealth(not problems, detail, versions.pop() if len(versions) == 1 else None)

    def close(self) -> None:
        try:
            self.prober.stop()
            self.transport.close()
            self.client.close()
            if self.generate_client is not self.client:
                self.generate_client.close()
        finally:
            if self.launcher is not None:
                self.launcher.shutdown()
