"""The CPU stand-in for SGLang's GPU scheduler process (one process per engine TP rank).

SGLang's real `launch_server` starts this through its `run_scheduler_process_func` hook, so the
HTTP app, the TokenizerManager (request parsing, `GenerateReqInput.normalize_batch_and_arguments`,
`SamplingParams.normalize()/verify()`, n>1 fan-out, pause/abort bookkeeping, weight-update locks,
output formatting) and the DetokenizerManager that surround it are SGLang's own processes.

What runs here is SGLang's code too, except the loop and the forward pass:
- requests are SGLang `Req` objects (their `update_finish_state` applies SGLang's stop rules), and
  finished ones go out through SGLang's `SchedulerOutputStreamer`;
- sampling is SGLang's `Sampler` (pytorch backend, the one SGLang uses on CPU and under
  `--enable-deterministic-inference`) for a batch of one: SGLang's own `SamplingBatchInfo` of the
  request, greedy (top_k <= 1) as `Sampler.forward`'s argmax, else `Sampler._sample_from_probs`
  with SGLang's torch-native sampler functions; `sampling_seed` takes effect only when the server
  runs with `--enable-deterministic-inference`, as in SGLang; returned log-probs are
  log_softmax(logits / temperature) before top-p/top-k/min-p (log_softmax(logits) for greedy), SGLang's
  default;
- sampling masks (`return_sampling_mask`, `sampling_logprobs_mode`): a request is refused exactly as
  SGLang's `Scheduler._handle_generate_request` refuses it (top_k must be 1 or 1 < top_k <=
  `--sampling-mask-max-tokens`, by SGLang's `_reject_sampling_mask_request`: HTTP 400); the support
  and behaviour log-prob come from SGLang's `top_k_top_p_min_p_sampling_from_probs_torch(...,
  return_filtered_probs=True)` and `Sampler._build_sampling_mask_output` /
  `_build_greedy_sampling_mask_output`, and go out through SGLang's
  `SchedulerBatchResultProcessor.materialize_sampling_mask_output` / `get_sampling_mask_finish_reason`
  / `add_sampling_mask_return_values` into `req.sampling_mask_rows`, which SGLang's output streamer
  and tokenizer manager turn into `meta_info["output_token_sampling_mask"]` /
  `["output_token_sampling_logprobs"]`. An overflowing or invalid support aborts the request without
  committing the token, as SGLang's `process_batch_result_decode` does (overflow: HTTP 400 naming
  `--sampling-mask-max-tokens`; invalid: 500). `--enable-fp32-lm-head` is accepted (the harness
  computes fp32 logits anyway);
- routed experts (`return_routed_experts`, `routed_experts_start_len`): SGLang's own checks of
  `Scheduler._handle_generate_request` (an out-of-range start aborts the request), its capturer
  and `_maybe_collect_routed_experts`, only with `--enable-return-routed-experts` (without it SGLang
  ignores the field); the routes are the HF MoE routers' own choices (routed_experts.py);
- weight updates, the begin/end session, release/resume tag bookkeeping, `/weights_checker` and
  `/get_weights_by_name` are SGLang's `SchedulerWeightUpdaterManager`, `WeightUpdater`,
  `WeightChecker` and `WeightExporter`, including `init_custom_process_group` + broadcast receive
  and `MultiprocessingSerializer` (SafeUnpickler); `/get_weights_by_name` answers only where SGLang's
  model class for the checkpoint's architecture has the method, and `/weights_checker` hashes what
  SGLang's dense models hold on each TP rank (fused q/k/v and gate/up, shards, padded vocabulary:
  model.py SGLangLayout);
- a request with max_new_tokens=0 samples nothing, as in SGLang (_finish_prefill_only);
- process groups come from SGLang's own `init_parallel_runtime(device="cpu")` (gloo); with
  `--tp-size N` the N ranks each hold a full copy of the model, rank 0 generates, and every rank
  runs every control request (SGLang broadcasts them the same way), so per-rank payloads and
  weight-update group ranks are exercised.
- load snapshots: rank 0 publishes SGLang's `LoadSnapshot` through SGLang's own
  `create_load_snapshot_writer` (shared memory on one node, as SGLang does by default), which the
  TokenizerManager's reader serves at GET /v1/loads (publish_load below); `--max-running-requests`
  caps the running requests, the rest wait, as in SGLang.
- returned log-probs beyond the sampled token's (`top_logprobs_num`, `token_ids_logprob`) are
  SGLang's `get_top_logprobs` / `get_token_ids_logprobs` over the same log-probs;
- reward / classification models are refused at start: SGLang's real runtime serves /classify on a
  CPU (tests/test_reward_models.py), so the harness has no model of it.
Ours: the decode loop (one HF forward per running request per step, KV cache in HF's cache),
the CPU memory saver (releasing `weights` zeroes them: SGLang drops their contents too unless
`--enable-weights-cpu-backup`), and a scheduler-side exception ends the server as SGLang's does
(SIGQUIT to the server process). Faults for tests come from environment variables (faults.py), and
one per request: a sampling-support cap below the server's (SUPPORT_CAP_FAULT below).
"""
from __future__ import annotations

from tests.sglang_harness import memory_saver_stub, torchvision_stub

torchvision_stub.install()
memory_saver_stub.install()

import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from tests.sglang_harness.faults import Faults  # noqa: E402

log = logging.getLogger("sglang_harness.scheduler")
MAX_TOTAL_NUM_TOKENS = 1 << 20  # the KV "pool" the scheduler reports (HF's cache has no bound)


def run_cpu_scheduler(server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank, pipe_writer, *args, **kwargs):
    """Drop-in for sglang.srt.managers.scheduler.run_scheduler_process (same arguments)."""
    import psutil
    from sglang.srt.managers.scheduler import resolve_spawn_dp_rank
    from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank

    publish(server_args, role="scheduler",
            ranks=SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=pp_rank),
                             dp_rank=resolve_spawn_dp_rank(dp_rank), gpu_id=gpu_id))
    torch.set_num_threads(1)
    parent = psutil.Process().parent()
    try:
        scheduler = CpuScheduler(server_args, port_args)
        pipe_writer.send(scheduler.init_info())
        scheduler.run_event_loop()
    except Exception:  # noqa: BLE001 - SGLang's scheduler ends the server on any exception
        log.error("Scheduler hit an exception: %s", traceback.format_exc())
        parent.send_signal(signal.SIGQUIT)


class CpuMemorySaver:
    """torch_memory_saver's pause/resume on CPU: pausing `weights` zeroes the model (the contents
    are gone, as on a GPU without a CPU backup); pausing `kv_cache` forbids generation."""

    def __init__(self, get_model):
        self.get_model = get_model
        self.paused: set[str] = set()

    def pause(self, tag: str) -> None:
        self.paused.add(tag)
        if tag == "weights":
            with torch.no_grad():
                for param in self.get_model().parameters():
                    param.zero_()

    def resume(self, tag: str) -> None:
        self.paused.discard(tag)


class CpuModelRunner:
    """What SGLang's weight-update code reads from a ModelRunner: the model, SGLang's own
    WeightUpdater bound to it, SGLang's WeightChecker, and SGLang's WeightExporter (whose
    get_weights_by_name answers None, i.e. HTTP 400 "Get parameter by name failed", where SGLang's
    model class for the checkpoint's architecture has no get_weights_by_name: Qwen2/Qwen3 in 0.5.23)."""

    def __init__(self, server_args, model_config, tp_rank: int):
        from sglang.srt.model_executor.model_runner_components.weight_exporter import WeightExporter
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
        from sglang.srt.utils.weight_checker import WeightChecker

        from tests.sglang_harness.model import DENSE_FUSED_CLASSES, SGLangLayout, load_causal_lm, sglang_model_class

        self.model_config = model_config
        if not model_config.is_generation:
            raise NotImplementedError(f"{server_args.model_path} is a reward / classification model: the harness "
                                      "serves generation models only (SGLang's real runtime serves /classify on a "
                                      "CPU, tests/test_reward_models.py)")
        self.model = load_causal_lm(server_args.model_path, model_config.dtype, sglang_model_class(model_config))
        self.tp_size = server_args.tp_size
        self.weight_updater = WeightUpdater(
            tp_rank=tp_rank, device="cpu", gpu_id=0, model_config=model_config, custom_weight_loaders={},
            get_model=lambda: self.model, update_model_fields=self._update_model_fields,
            recapture_cuda_graph=lambda: None, get_model_runner=lambda: self)
        # /weights_checker sees SGLang's fused, TP-sharded parameters for its dense models (model.py
        # SGLangLayout); its reset_tensors writes into the HF model itself
        self._raw_checker = WeightChecker(get_model=lambda: self.model)
        self._weight_checker = self._raw_checker
        if sglang_model_class(model_config).__name__ in DENSE_FUSED_CLASSES:
            self._weight_checker = WeightChecker(get_model=lambda: SGLangLayout(
                self.model, model_config.hf_config, tp_rank, server_args.tp_size))
        self.weight_exporter = WeightExporter(tp_rank=tp_rank, tp_size=self.tp_size, gpu_id=0,
                                              get_model_path=lambda: server_args.model_path,
                                              get_model=lambda: self.model)

    def _update_model_fields(self, model, **fields) -> None:
        self.model = model

    def check_weights(self, action: str, allow_quant_error: bool = False, skip_tensor_list=None, *, role: str):
        checker = self._raw_checker if action == "reset_tensors" else self._weight_checker
        return checker.handle(action=action, allow_quant_error=allow_quant_error, skip_tensor_list=skip_tensor_list,
                              role=role)


class CpuTpWorker:
    """The TpModelWorker methods the weight-update manager calls, taken from SGLang's class."""

    def __init__(self, model_runner: CpuModelRunner):
        from sglang.srt.managers.tp_worker import TpModelWorker

        self.model_runner = model_runner
        self._model_runner = model_runner
        self.model_config = model_runner.model_config
        for name in ("init_weights_update_group", "destroy_weights_update_group", "deserialize_own_rank",
                     "get_weights_by_name", "weight_update_runners"):
            setattr(self, name, getattr(TpModelWorker, name).__get__(self))


class Running:
    """One request being decoded: SGLang's Req plus our HF KV cache and its SGLang SamplingBatchInfo
    (a batch of one: the same at every step)."""

    def __init__(self, req, past_key_values=None):
        self.req = req
        self.past_key_values = past_key_values
        self.batch = OneRequestBatch(req)  # the batch info's penalizers hold it by a weak reference
        self.sampling_info = None
        self.fed = False  # whether a forward (SGLang's prefill) has run for it


class CpuScheduler:
    def __init__(self, server_args, port_args):
        import zmq
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.distributed.bootstrap import init_parallel_runtime
        from sglang.srt.managers.scheduler_components.ipc_channels import SchedulerIpcChannels
        from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
        from sglang.srt.runtime_context import get_parallel, get_serving
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        from sglang.srt.utils.hf_transformers_utils import get_tokenizer

        from tests.sglang_harness import kernels

        kernels.install()
        self.server_args = server_args
        self.faults = Faults.from_env()
        init_parallel_runtime(server_args=server_args, device="cpu", dist_port=port_args.nccl_port)
        self.tp_rank, self.tp_size = get_parallel().tp_rank, get_parallel().tp_size
        self.tp_cpu_group = get_parallel().tp_group.cpu_group
        self.model_config = ModelConfig.from_server_args(server_args)
        self.tokenizer = get_tokenizer(get_serving().tokenizer_path or server_args.model_path)
        self.runner = CpuModelRunner(server_args, self.model_config, self.tp_rank)
        self.routes = None  # SGLang's routed-experts capture (--enable-return-routed-experts), rank 0
        if self.model_config.is_generation and self.tp_rank == 0:
            from tests.sglang_harness.routed_experts import RoutedExpertsCapture

            self.routes = RoutedExpertsCapture.create(self.runner.model, self.model_config)
        self.req_to_token_pool = self.routes.req_to_token_pool if self.routes is not None else None
        self.sampler = make_sampler(self.tp_size)
        self.memory_saver = CpuMemorySaver(lambda: self.runner.model)
        self.disaggregation_mode = DisaggregationMode.NULL
        self._engine_paused = False
        self.waiting: list = []
        self.running: list[Running] = []
        self.ipc = SchedulerIpcChannels.create(port_args=port_args, is_rank_zero=self.tp_rank == 0,
                                               skip_tokenizer_init=server_args.skip_tokenizer_init,
                                               metrics_enabled=False, enable_scripted_runtime=False)
        self.poller = None
        if self.ipc.recv_from_tokenizer is not None:
            self.poller = zmq.Poller()
            self.poller.register(self.ipc.recv_from_tokenizer, zmq.POLLIN)
        self.weight_updater = SchedulerWeightUpdaterManager(
            tp_worker=CpuTpWorker(self.runner), draft_worker=None, memory_saver_adapter=self.memory_saver,
            flush_cache=self.flush_cache, is_fully_idle=self.is_fully_idle, scheduler=self)
        self.output_streamer = SchedulerOutputStreamer(
            send_to_detokenizer=self.ipc.send_to_detokenizer, tree_cache=None, server_args=server_args,
            is_generation=self.model_config.is_generation, spec_algorithm=SpeculativeAlgorithm.NONE,
            disaggregation_mode=self.disaggregation_mode,
            enable_hicache_storage=lambda: False)
        self.dispatcher = self._build_dispatcher()
        self.generate_count = 0
        self._bind_sglang_methods()
        # HARNESS_INSTANT's token: the EOS, which SGLang's stop rules end the request on
        eos = self.tokenizer.eos_token_id
        self.instant_token = eos if eos is not None else min(self.model_config.hf_eos_token_id or {0})
        self.max_running_requests = server_args.max_running_requests or default_max_running_requests(
            MAX_TOTAL_NUM_TOKENS, self.model_config.context_len)
        self.load_snapshot_writer = None
        self._published_counts = None
        if self.tp_rank == 0:
            self.load_snapshot_writer = make_load_snapshot_writer(port_args)
            self.publish_load(decoded=False)

    def _bind_sglang_methods(self) -> None:
        """SGLang's own scheduler code for sampling masks, bound to this scheduler: what they read
        of `self` here is `output_streamer` (the reject path) and nothing else (the mask methods of the
        batch result processor use no state for non-speculative rows)."""
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor

        processor = SchedulerBatchResultProcessor
        self.materialize_sampling_mask_output = processor.materialize_sampling_mask_output  # a staticmethod
        self.get_sampling_mask_finish_reason = processor.get_sampling_mask_finish_reason.__get__(self)
        self.add_sampling_mask_return_values = processor.add_sampling_mask_return_values.__get__(self)
        self._reject_sampling_mask_request = Scheduler._reject_sampling_mask_request.__get__(self)
        self._maybe_collect_routed_experts = processor._maybe_collect_routed_experts.__get__(self)

    def init_info(self) -> dict[str, Any]:
        return {"status": "ready", "max_total_num_tokens": MAX_TOTAL_NUM_TOKENS,
                "max_req_input_len": self.model_config.context_len - 1, "startup_time": {}}

    def _build_dispatcher(self):
        from sglang.srt.managers import io_struct as io
        from sglang.utils import TypeBasedDispatcher

        w = self.weight_updater
        return TypeBasedDispatcher([
            (io.TokenizedGenerateReqInput, self.handle_generate_request),
            (io.BatchTokenizedGenerateReqInput, self.handle_batch_generate_request),
            (io.FlushCacheReqInput, lambda req: io.FlushCacheReqOutput(success=self.flush_cache())),
            (io.AbortReq, self.abort_request),
            (io.PauseGenerationReqInput, self.pause_generation),
            (io.ContinueGenerationReqInput, self.continue_generation),
            (io.UpdateWeightVersionReqInput, self.handle_update_weight_version),
            (io.FreezeGCReq, lambda req: None),
            (io.GetInternalStateReq, lambda req: io.GetInternalStateReqOutput(internal_state={})),
            (io.UpdateWeightFromDiskReqInput, w.update_weights_from_disk),
            (io.InitWeightsUpdateGroupReqInput, w.init_weights_update_group),
            (io.DestroyWeightsUpdateGroupReqInput, w.destroy_weights_update_group),
            (io.BeginWeightUpdateReqInput, w.begin_weight_update),
            (io.EndWeightUpdateReqInput, w.end_weight_update),
            (io.UpdateWeightsFromDistributedReqInput, w.update_weights_from_distributed),
            (io.UpdateWeightsFromTensorReqInput, w.update_weights_from_tensor),
            (io.GetWeightsByNameReqInput, w.get_weights_by_name),
            (io.ReleaseMemoryOccupationReqInput, w.release_memory_occupation),
            (io.ResumeMemoryOccupationReqInput, w.resume_memory_occupation),
            (io.CheckWeightsReqInput, w.check_weights),
        ])

    # ----- the event loop -----------------------------------------------------------------------
    def run_event_loop(self) -> None:
        while True:
            for recv_req in self.recv_requests():
                if _is_health_check(recv_req) and not self.is_fully_idle():
                    continue  # SGLang skips the probe when busy: running requests prove health
                output = self.dispatcher(recv_req)
                if output is not None:
                    self.ipc.send_to_tokenizer.send_output(output, recv_req)
            decoded = not self._engine_paused and self.step()
            self.publish_load(decoded)

    def recv_requests(self) -> list:
        """Rank 0 drains its socket (waiting briefly when idle); SGLang broadcasts the list to the
        other TP ranks so that every rank runs every control request."""
        import zmq
        from sglang.srt.utils import broadcast_pyobj

        reqs = []
        if self.tp_rank == 0:
            idle = not (self.waiting or self.running) or self._engine_paused
            if self.poller.poll(50 if idle else 0):
                while True:
                    try:
                        reqs.append(self.ipc.recv_from_tokenizer.recv_pyobj(zmq.NOBLOCK))
                    except zmq.ZMQError:
                        break
        if self.tp_size > 1:
            reqs = broadcast_pyobj(reqs, self.tp_rank, self.tp_cpu_group, src=0)
        return reqs

    def step(self) -> bool:
        """Prefill the waiting requests (up to --max-running-requests running), then one decode step
        for every running one (rank 0 only). Whether it decoded."""
        if self.tp_rank != 0:
            return False
        if (self.waiting or self.running) and "kv_cache" in self.memory_saver.paused:
            raise RuntimeError("generation while the KV cache is released (release_memory_occupation)")
        while self.waiting and len(self.running) < self.max_running_requests:
            req = self.waiting.pop(0)
            self.running.append(Running(req))
        if not self.running:
            return False
        for item in self.running:
            self._decode_one(item)
        # SGLang streams after every step: finished requests, and unfinished ones every
        # SGLANG_FORCE_STREAM_INTERVAL tokens (what keeps /health_generate answering while busy).
        reqs = [item.req for item in self.running]
        self.output_streamer.stream_output(reqs, any(r.return_logprob for r in reqs))
        self.running = [item for item in self.running if not item.req.finished()]
        return True

    def publish_load(self, decoded: bool) -> None:
        """SGLang's Scheduler.publish_load_snapshot, what GET /v1/loads serves: at once when the
        numbers of running or waiting requests changed (SGLang publishes at once on prefill and when
        idle), else every --load-snapshot-publish-interval decode steps (SGLang's throttle; the token
        counts grow). Counts are sequences: SGLang's TokenizerManager fans a request with n > 1 out
        into n of them."""
        writer = self.load_snapshot_writer
        if writer is None:
            return
        counts = (len(self.running), len(self.waiting))
        if counts == self._published_counts:
            if not decoded:
                return
            writer.publish_counter += 1
            if writer.publish_counter < writer.publish_interval:
                return
        writer.publish_counter = 0
        self._published_counts = counts
        writer.write(self.load_snapshot())

    def load_snapshot(self):
        """SGLang's SchedulerLoadInquirer.get_loads for this scheduler: no prefix cache, no
        disaggregation, no grammar queue; the KV tokens in use are the running requests' lengths."""
        import time

        from sglang.srt.managers.load_snapshot import DisaggregationMetrics, LoadSnapshot, QueueMetrics

        used = sum(item.req.seqlen for item in self.running)
        total = used + sum(req.seqlen for req in self.waiting)
        return LoadSnapshot(
            dp_rank=self.load_snapshot_writer.dp_rank, timestamp=time.time(), num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_waiting_uncached_tokens=sum(len(req.origin_input_ids) for req in self.waiting),
            num_used_tokens=used, num_total_tokens=total, num_active_tokens=total,
            max_total_num_tokens=MAX_TOTAL_NUM_TOKENS, max_running_requests=self.max_running_requests,
            token_usage=used / MAX_TOTAL_NUM_TOKENS,
            disaggregation=DisaggregationMetrics(mode="null"),
            queues=QueueMetrics(waiting=len(self.waiting), grammar=0, paused=0, retracted=0, prealloc_ready=0))

    @torch.no_grad()
    def _decode_one(self, item: Running) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH

        req = item.req
        if req.to_finish is not None:
            req.update_finish_state(0)
            self._finished_routes(req, collect=True)
            return
        prefill, locations = not item.fed, None
        if self.routes is not None:  # the KV locations of the tokens this step feeds
            fed = len(req.origin_input_ids) + len(req.output_ids) if prefill else 1
            locations = self.routes.feed(self.runner.model, req, fed)
        item.fed = True
        if self.faults.instant:
            token, logprob, logits_output, logprobs = self._instant_token(req)
        else:
            token, logprob, logits_output, logprobs = self._forward_and_sample(item, locations)
        if prefill and req.is_prefill_only:
            self._finish_prefill_only(req)
            return
        # SGLang's SchedulerBatchResultProcessor.process_batch_result_decode (and _prefill) for one row:
        # an unusable sampling mask finishes the request without committing the sampled token.
        if req.return_sampling_mask:
            self.materialize_sampling_mask_output([req], logits_output)
            statuses = logits_output.next_token_sampling_mask_status
            finish_reason = self.get_sampling_mask_finish_reason(status=None if statuses is None else statuses[0])
            if finish_reason is not None:
                req.to_finish = finish_reason
                req.update_finish_state(0)
                # SGLang collects routes of a request finished in decode, not of one discarded at prefill
                self._finished_routes(req, collect=not prefill)
                return
        req.output_ids.append(token)
        req.update_finish_state(1)
        if self.faults.instant and not req.finished():  # ignore_eos: SGLang's rules would go on
            req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
            req.finished_len = len(req.output_ids)
        if req.return_logprob:
            req.logprob.output_token_logprobs_val.append(logprob)
            req.logprob.output_token_logprobs_idx.append(token)
            self._add_requested_logprobs(req, logprobs)
        if req.return_sampling_mask:
            self.add_sampling_mask_return_values(0, req, logits_output)
        if req.finished():
            self._finished_routes(req, collect=True)

    def _finish_prefill_only(self, req) -> None:
        """A request with max_new_tokens=0 (SGLang's Req.is_prefill_only; also the prefix warm-up
        SGLang's TokenizerManager sends before an n > 1 request), alone in its batch as here: SGLang's
        TpModelWorker samples nothing for such a batch (dummy token 0), so there is no sampling mask
        (a request that asked for one is aborted, HTTP 500 "The sampling backend did not return
        captured sampling support.", and so is the n > 1 request behind such a warm-up), and its
        logprob processor adds no output log-prob. (Batched with generating requests, SGLang would
        sample it with them: never here, the harsher answer.)"""
        if req.return_sampling_mask:
            req.to_finish = self.get_sampling_mask_finish_reason(status=None)
            req.update_finish_state(0)
            self._finished_routes(req, collect=False)
            return
        req.output_ids.append(0)  # process_batch_result_prefill commits the dummy token; the stop rules cut it
        req.update_finish_state(1)
        self._finished_routes(req, collect=True)

    def _finished_routes(self, req, collect: bool) -> None:
        """A finished request: SGLang's _maybe_collect_routed_experts (if it ran a forward), then its
        KV locations are released."""
        if self.routes is None:
            return
        if collect and req.kv.req_pool_idx is not None:
            self._maybe_collect_routed_experts(req)
        self.routes.release(req)

    @staticmethod
    def _add_requested_logprobs(req, logprobs: torch.Tensor) -> None:
        """top_logprobs_num / token_ids_logprob of one decoded position, by SGLang's own
        get_top_logprobs / get_token_ids_logprobs over the position's log-probs (the same
        log_softmax as the returned token's), appended as SchedulerBatchResultProcessor does."""
        from sglang.srt.layers.logprob_processor import get_token_ids_logprobs, get_top_logprobs

        if req.logprob.top_logprobs_num > 0:
            values, indices = get_top_logprobs(logprobs, [req.logprob.top_logprobs_num])
            req.logprob.output_top_logprobs_val.append(values[0])
            req.logprob.output_top_logprobs_idx.append(indices[0])
        if req.logprob.token_ids_logprob is not None:
            values, indices = get_token_ids_logprobs(logprobs, [req.logprob.token_ids_logprob])
            req.logprob.output_token_ids_logprobs_val.append(values[0])
            req.logprob.output_token_ids_logprobs_idx.append(indices[0])

    def _instant_token(self, req):
        """HARNESS_INSTANT, no forward pass: the "model" answers EOS with certainty (log-prob 0.0), so
        that SGLang's stop rules end the request ("stop", matched EOS; with ignore_eos, _decode_one ends
        it as "length"). A sampling mask, if asked for, is SGLang's greedy one (support {EOS}, log-prob
        0): that same distribution."""
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput

        output = LogitsProcessorOutput(next_token_logits=None)
        if req.return_sampling_mask:
            support_rows = torch.tensor([0]) if req.sampling_logprobs_mode == "support" else None
            output.sampling_mask_output = self.sampler._build_greedy_sampling_mask_output(
                torch.tensor([0]), torch.tensor([self.instant_token]), support_rows)
        logprobs = torch.full((1, self.model_config.vocab_size), -float("inf"))
        logprobs[0, self.instant_token] = 0.0
        return self.instant_token, 0.0, output, logprobs

    def _forward_and_sample(self, item: Running, locations=None):
        """One HF forward of the request (its whole sequence at first, then the last token on the
        cache) and SGLang's sampling of its next token: (token, log-prob, LogitsProcessorOutput, log-probs).
        `locations`: the fed tokens' KV locations when routed experts are captured."""
        from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

        req = item.req
        if item.past_key_values is None:
            tokens = list(req.origin_input_ids) + list(req.output_ids)
        else:
            tokens = [req.output_ids[-1]]
        self.faults.before_forward()
        out = self.runner.model(input_ids=torch.tensor([tokens]), past_key_values=item.past_key_values,
                                use_cache=True)
        item.past_key_values = out.past_key_values
        if locations is not None:
            self.routes.forward_end(locations)
        position = len(req.origin_input_ids) + len(req.output_ids)
        if item.sampling_info is None:
            # SGLang's own batch info of this request: temperatures, top_ks / top_ps / min_ps, the seed
            # (only with --enable-deterministic-inference; 42 if the request has none), is_all_greedy,
            # need_*_sampling, max_top_k and the rows that return sampling masks.
            item.sampling_info = SamplingBatchInfo.from_schedule_batch(item.batch, self.model_config.vocab_size)
        return self._sample(out.logits[0, -1].float(), req, item.sampling_info, position)

    def _sample(self, logits: torch.Tensor, req, info, position: int):
        """SGLang's `Sampler.forward` (pytorch backend) for a batch of one request with its batch info
        `info`: the token, its log-prob, the LogitsProcessorOutput that carries the sampling mask
        (if asked for), and the position's log-probs [1, vocab]."""
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput

        logits = logits.unsqueeze(0)
        positions = torch.tensor([position])
        output = LogitsProcessorOutput(next_token_logits=logits)
        capture = None
        if info.is_all_greedy:  # Sampler.forward: argmax, log-probs of the unscaled logits
            token = torch.argmax(logits, -1)
            logprobs = torch.log_softmax(logits, dim=-1)
        else:
            simple_sampling_case = not (info.need_top_p_sampling or info.need_top_k_sampling
                                        or info.need_min_p_sampling)
            logits = logits / info.temperatures
            logprobs = torch.log_softmax(logits, dim=-1)
            token, capture = self.sampler._sample_from_probs(torch.softmax(logits, dim=-1), info, positions,
                                                             simple_sampling_case)
        # (Sampler.forward drops the capture's selected weight when token ids are synchronised
        # across TP ranks or grammars constrain them; neither happens here.)
        if info.sampling_mask_batch_indices is not None:
            if info.is_all_greedy:
                output.sampling_mask_output = self.sampler._build_greedy_sampling_mask_output(
                    info.sampling_mask_batch_indices, token, info.sampling_support_logprobs_capture_indices)
            else:
                cap = self.sampler.sampling_mask_max_tokens
                self.sampler.sampling_mask_max_tokens = _support_cap_fault(req, cap)
                try:
                    output.sampling_mask_output = self.sampler._build_sampling_mask_output(
                        token, capture, info.sampling_support_logprobs_capture_indices)
                finally:
                    self.sampler.sampling_mask_max_tokens = cap
        token_id = int(token.view(-1)[0])
        return token_id, float(logprobs[0, token_id]), output, logprobs

    # ----- requests -----------------------------------------------------------------------------
    def handle_generate_request(self, recv_req) -> None:
        from sglang.srt.managers.schedule_batch import Req

        if self.tp_rank != 0:
            return  # only rank 0 decodes (SGLang's ranks would each run their shard of the batch)
        if not _is_health_check(recv_req):  # faults count the clients' requests, not probes
            self.generate_count += 1
            self.faults.on_generate(self.generate_count)
        req = Req(recv_req.rid, recv_req.input_text, recv_req.input_ids, recv_req.sampling_params,
                  return_logprob=recv_req.return_logprob, top_logprobs_num=recv_req.top_logprobs_num,
                  token_ids_logprob=recv_req.token_ids_logprob, return_sampling_mask=recv_req.return_sampling_mask,
                  sampling_logprobs_mode=recv_req.sampling_logprobs_mode, stream=recv_req.stream,
                  return_routed_experts=recv_req.return_routed_experts,
                  routed_experts_start_len=recv_req.routed_experts_start_len,
                  eos_token_ids=self.model_config.hf_eos_token_id, vocab_size=self.model_config.vocab_size,
                  http_worker_ipc=recv_req.http_worker_ipc, time_stats=recv_req.time_stats)
        req.tokenizer = self.tokenizer
        if recv_req.return_logprob:
            for field in ("output_token_logprobs_val", "output_token_logprobs_idx", "output_top_logprobs_val",
                          "output_top_logprobs_idx", "output_token_ids_logprobs_val",
                          "output_token_ids_logprobs_idx"):
                setattr(req.logprob, field, [])
        if req.return_sampling_mask:
            # SGLang's Scheduler._handle_generate_request, line for line (no disaggregation, no
            # speculative decoding, no ascend backend here: their checks cannot apply)
            top_k = req.sampling_params.top_k
            sampling_mask_cap = self.server_args.sampling_mask_max_tokens
            if top_k != 1 and not (1 < top_k <= sampling_mask_cap):
                error_msg = (
                    "return_sampling_mask requires top_k=1 for greedy sampling "
                    f"or finite 1 < top_k <= {sampling_mask_cap}; got top_k="
                    f"{top_k}. Lower top_k or increase "
                    "--sampling-mask-max-tokens."
                )
                self._reject_sampling_mask_request(req, error_msg)
                return
        if recv_req.return_routed_experts:
            # SGLang's Scheduler._handle_generate_request, line for line
            error_msg = None
            if recv_req.routed_experts_start_len < 0:
                error_msg = (
                    f"{recv_req.routed_experts_start_len=} is lower than 0. "
                    "Please use a non-negative routed_experts_start_len."
                )

            if recv_req.routed_experts_start_len > len(req.origin_input_ids):
                error_msg = (
                    f"{recv_req.routed_experts_start_len=} is higher than the "
                    f"number of input tokens {len(req.origin_input_ids)=}. Please "
                    f"use a smaller routed_experts_start_len."
                )

            if error_msg is not None:
                req.routed_experts_start_len = 0
                req.set_finish_with_abort(error_msg)
                self.waiting.append(req)  # SGLang's _add_request_to_queue: it finishes as aborted
                return
        if len(req.origin_input_ids) >= self.model_config.context_len:
            req.set_finish_with_abort(f"the input ({len(req.origin_input_ids)} tokens) is longer than the "
                                      f"model's context length ({self.model_config.context_len})")
            self.output_streamer.stream_output([req], req.return_logprob)
            return
        self.waiting.append(req)

    def handle_batch_generate_request(self, batch) -> None:
        for recv_req in batch:
            self.handle_generate_request(recv_req)

    def abort_request(self, recv_req) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT
        from sglang.srt.managers.scheduler import _make_abort_req

        def matches(req) -> bool:
            return recv_req.abort_all or req.rid.startswith(recv_req.rid)

        for req in [r for r in self.waiting if matches(r)]:
            self.waiting.remove(req)
            self.ipc.send_to_tokenizer.send_output(_make_abort_req(req, finished_reason=recv_req.finished_reason), req)
        for item in self.running:
            if not item.req.finished() and matches(item.req):
                item.req.to_finish = FINISH_ABORT()

    def pause_generation(self, recv_req) -> None:
        self._engine_paused = True  # in_place and retract both stop the loop; nothing is lost

    def continue_generation(self, recv_req) -> None:
        self._engine_paused = False

    def handle_update_weight_version(self, recv_req):
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqOutput

        self.record_weight_version_change(new_version=recv_req.new_version)
        return UpdateWeightVersionReqOutput()

    def record_weight_version_change(self, new_version) -> None:
        from sglang.srt.runtime_context import get_context, get_serving
        from sglang.srt.utils.weight_versions import record_weight_version_events

        if new_version is None or new_version == get_serving().weight_version:
            return
        old_version = get_serving().weight_version
        get_context().override("scheduler.weight_version", weight_version=new_version)
        record_weight_version_events({*(i.req for i in self.running), *self.waiting}, old_version=old_version)

    def is_fully_idle(self, for_health_check: bool = False, ignore_waiting: bool = False) -> bool:
        return not self.running and (ignore_waiting or not self.waiting)

    def flush_cache(self, empty_cache: bool = True) -> bool:
        """SGLang refuses to flush while requests run or wait; there is no prefix cache here."""
        return self.is_fully_idle()


# A test fault for one request (the server's flags stay SGLang's): sampling_params.custom_params
# {"harness_sampler_support_cap": C} makes the sampler hold that request's supports to C tokens,
# below the admission bound --sampling-mask-max-tokens. On SGLang's pytorch backend a support never
# exceeds top_k (<= that bound); on FlashInfer's, ties at the top-k cut-off can widen it past the
# bound. With the fault, SGLang's own overflow status, abort and HTTP 400 follow.
SUPPORT_CAP_FAULT = "harness_sampler_support_cap"


def _support_cap_fault(req, cap: int) -> int:
    custom = req.sampling_params.custom_params or {}
    return int(custom[SUPPORT_CAP_FAULT]) if SUPPORT_CAP_FAULT in custom else cap


class OneRequestBatch:
    """What SGLang's SamplingBatchInfo.from_schedule_batch reads of a ScheduleBatch (and its
    penalizer orchestrator keeps a weak reference to): the requests and the device."""

    def __init__(self, req):
        self.reqs = [req]
        self.device = "cpu"


def default_max_running_requests(max_total_num_tokens: int, context_len: int) -> int:
    """SGLang's default --max-running-requests for a KV pool of max_total_num_tokens tokens
    (MemoryPoolConfigurator._resolve_max_running_requests_per_worker)."""
    estimated = max(min(int(max_total_num_tokens / context_len * 512), 4096), 2048)
    return min(estimated, max_total_num_tokens // 2)


def make_load_snapshot_writer(port_args):
    """SGLang's load snapshot writer of a DP rank's scheduler (Scheduler.init_ipc_channels: shared
    memory, or zmq for multi-node DP attention / SGLANG_LOAD_SNAPSHOT_USE_ZMQ=1); as in SGLang, a
    failure leaves the scheduler without one (GET /v1/loads then answers no loads)."""
    from sglang.srt.managers.load_snapshot import create_load_snapshot_writer
    from sglang.srt.runtime_context import get_observability, get_parallel

    dp_rank = get_parallel().dp_rank if get_parallel().dp_rank is not None else 0
    try:
        writer = create_load_snapshot_writer(port_args, get_parallel().num_dp_ranks, dp_rank,
                                             publish_interval=get_observability().load_snapshot_publish_interval)
    except Exception as e:  # noqa: BLE001 - SGLang's words and behaviour
        log.warning("load snapshot writer init failed: %s", e)
        return None
    if getattr(writer, "path", None):
        _unlink_on_sigterm(writer.path)
    return writer


def _unlink_on_sigterm(path: str) -> None:
    """SGLang leaves its /dev/shm/sglang_loads_* file behind (only its CI sweeps them); test servers
    start by the hundred, so the harness removes it when its process group gets SIGTERM (the
    launcher's shutdown), then dies of the signal as before. The TokenizerManager's mapping stays
    readable."""
    previous = signal.getsignal(signal.SIGTERM)

    def unlink_and_die(signum, frame):
        try:
            os.unlink(path)
        except OSError:
            pass
        if callable(previous):
            previous(signum, frame)
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, unlink_and_die)


def make_sampler(tp_size: int):
    """SGLang's own Sampler, built in this scheduler process (it reads the parallel state and the
    server's --sampling-mask-max-tokens). SGLang's TP ranks all sample the batch and MAX-reduce the
    sampling-mask statuses over the TP group (Sampler._build_sampling_mask_output), so that every
    rank takes the same abort decision; here only rank 0 samples, so its group is rank 0 alone
    (created on every rank, as torch.distributed.new_group requires), where the reduction is the
    identity."""
    import torch.distributed as dist
    from sglang.srt.layers.sampler import Sampler
    from sglang.srt.runtime_context import get_parallel

    sampler = Sampler()
    if tp_size > 1:
        sampler.tp_sync_group = dist.new_group([get_parallel().tp_group.ranks[0]], backend="gloo")
    return sampler


def _is_health_check(recv_req) -> bool:
    from sglang.srt.managers.utils import is_health_check_generate_req

    return is_health_check_generate_req(recv_req)
