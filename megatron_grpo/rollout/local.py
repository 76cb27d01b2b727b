"""LocalEngine: an in-process HF transformers causal LM that samples with a KV cache.

The embedded default's rollout engine (CPU or one GPU). All n x prompts sequences decode as one
batch: prompts are left-padded (attention mask + explicit position ids), each distinct prompt is
prefilled once and its KV cache repeated for its n samples, and finished rows are dropped from the
batch once a quarter of it has finished. A request that continues a sequence kept by an earlier call
(GenerationRequest.keep_kv: an episode's next turn) prefills only its new ids (rollout/kept_kv.py)."""
from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from megatron_grpo.convert.fused_experts import fuse_expert_tensors
from megatron_grpo.rollout.engine import NamedTensors, RequestDone, RolloutEngine
from megatron_grpo.rollout.kept_kv import KeptPrefix, KeptPrefixes
from megatron_grpo.rollout.sampling import make_state, sample_tokens
from megatron_grpo.rollout.types import (EngineHealth, GenerationRequest, Sample, SamplingParams,
                                         derive_sample_seed)
from megatron_grpo.rollout.routed_experts import RoutedExpertsRecorder, sparse_blocks
from megatron_grpo.rollout.weights import HFWeightLoader, WeightLoadReport

# Compact the batch once this fraction of its rows has finished: the copy of the KV cache costs
# about one decoding step, so doing it for every finished row would cost more than it saves.
_COMPACT_FRACTION = 0.25


@dataclass
class _Row:
    """One sequence being decoded (sample `sample_index` of request `request_index`)."""

    request_index: int
    sample_index: int
    params: SamplingParams
    stop_ids: frozenset[int]
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    behaviour: list[float] = field(default_factory=list)  # truncated sampling: the log-prob it was drawn with
    support: list[list[int]] = field(default_factory=list)  # sampling-support replay: each token's support
    finish: str | None = None
    routed: list[torch.Tensor] = field(default_factory=list)  # MoE: [positions, layers, k] pieces
    matched: int | str | None = None


class _FinishedRequests:
    """The samples of one generate call, told to on_request_done request by request as soon as all of
    a request's rows have finished (each request once; poll() after rows may have finished)."""

    def __init__(self, requests: Sequence[GenerationRequest], rows: list[_Row], version: int,
                 on_request_done: RequestDone | None):
        self.requests, self.rows, self.version, self.on_request_done = requests, rows, version, on_request_done
        self._open = [req.sampling.n for req in requests]  # unfinished rows per request
        self._rows_of: list[list[_Row]] = [[] for _ in requests]
        for row in rows:
            self._rows_of[row.request_index].append(row)
        self._seen: set[int] = set()
        self._built: dict[int, Sample] = {}

    def poll(self, rows: Sequence[_Row]) -> None:
        for row in rows:
            if row.finish is None or id(row) in self._seen:
                continue
            self._seen.add(id(row))
            self._open[row.request_index] -= 1
            if self._open[row.request_index] == 0 and self.on_request_done is not None:
                self.on_request_done(row.request_index, self._request_samples(row.request_index))

    def samples(self) -> list[Sample]:
        return [self._sample(r) for r in self.rows]

    def _request_samples(self, index: int) -> list[Sample]:
        return [self._sample(r) for r in self._rows_of[index]]

    def _sample(self, r: _Row) -> Sample:
        # routes as numpy int32: a torch tensor would cross the engine process's pipe through torch's
        # shared-memory reduction (fd passing), which the trainer's process cannot authenticate
        if id(r) not in self._built:
            request = self.requests[r.request_index]
            self._built[id(r)] = Sample(
                group_id=request.group_id, sample_index=r.sample_index, prompt_ids=list(request.prompt_ids),
                response_ids=r.response, logprobs=r.logprobs, finish_reason=r.finish, weight_version=self.version,
                matched_stop=r.matched, routed_experts=torch.cat(r.routed).numpy() if r.routed else None,
                behaviour_logprobs=r.behaviour if r.params.truncated else None,
                sampling_support=r.support if request.return_support else None, engine="local")
        return self._built[id(r)]


def _names_per_storage(model: torch.nn.Module) -> dict[str, list[str]]:
    """First name of each parameter storage -> all its names (tied embeddings have two)."""
    by_storage: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_storage.setdefault(id(param), []).append(name)
    return {names[0]: names for names in by_storage.values()}


def _upcast_lm_head(model: torch.nn.Module) -> None:
    """model.fp32_lm_head: the LM head's matmul in fp32 (as the trainer's, models/fp32_head.py)."""
    head = model.get_output_embeddings()
    if head is None or head.weight.dtype == torch.float32:
        return

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden.float(), head.weight.float(),
                                          None if head.bias is None else head.bias.float())

    head.forward = forward


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


class LocalEngine(RolloutEngine):
    """Samples from `model` (an HF causal LM) in this process; see the module docstring.

    `tokenizer` is only needed for stop strings. EOS ids come from `eos_token_ids`, else the
    model's generation config / config, else the tokenizer. `max_batch_rows` bounds the number
    of sequences decoded together (memory); `seed` seeds the requests that carry none.
    With `record_routed_experts`, a MoE model's samples carry their routes (Sample.routed_experts);
    such a model keeps no KV between calls (a continued prefix would have no routes).
    `kept_kv_bytes` bounds the KV kept for requests with keep_kv."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, *, device: str | torch.device = "cpu",
                 eos_token_ids: Sequence[int] | None = None, seed: int = 0, max_batch_rows: int = 256,
                 record_routed_experts: bool = True, kept_kv_bytes: int = 1 << 30):
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.max_batch_rows = max_batch_rows
        self._loader = HFWeightLoader(self.model)
        self._aliases = _names_per_storage(self.model)
        self._lock = threading.RLock()  # generate and update_weights never interleave
        self._abort_epoch = 0  # abort() bumps it; a generate() that began before is aborted
        self._version = 0
        self._seed_generator = torch.Generator().manual_seed(seed)
        self.eos_token_ids = frozenset(self._find_eos(eos_token_ids))
        params = inspect.signature(self.model.forward).parameters
        # transformers >= 5.x renamed past_key_values to cache; accept both generations.
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in params
        # MoE models: every sample carries the experts each position was routed to (routing replay;
        # record_routed_experts=False when the trainer does not replay them: no hooks, no copies)
        self._recorder = (RoutedExpertsRecorder(self.model) if record_routed_experts and sparse_blocks(self.model)
                          else None)
        self._kept = KeptPrefixes(kept_kv_bytes)

    # ----- construction -----------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, tokenizer_path: str | Path | None = None,
                        fp32_lm_head: bool = False, **kwargs: Any) -> "LocalEngine":
        """With fp32_lm_head the LM head computes in fp32 (model.fp32_lm_head, as the trainer's)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"local rollout engine: {path} has no config.json (expected an HF model folder)")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        if fp32_lm_head:
            _upcast_lm_head(model)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or path)
        return cls(model, tokenizer, device=device, **kwargs)

    @classmethod
    def from_config(cls, config: Any, tokenizer: Any = None, *, init_seed: int = 0,
                    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                    **kwargs: Any) -> "LocalEngine":
        from transformers import AutoModelForCausalLM

        torch.manual_seed(init_seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return cls(model, tokenizer, device=device, **kwargs)

    def _find_eos(self, explicit: Sequence[int] | None) -> list[int]:
        if explicit is not None:
            return _as_id_list(explicit)
        for source in (getattr(self.model, "generation_config", None), getattr(self.model, "config", None),
                       self.tokenizer):
            ids = _as_id_list(getattr(source, "eos_token_id", None)) if source is not None else []
            if ids:
                return ids
        return []

    # ----- RolloutEngine ----------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, requests: Sequence[GenerationRequest],
                 on_request_done: RequestDone | None = None) -> list[Sample]:
        """Every request's samples; on_request_done hears of each request as soon as its last row has
        finished (mid-call: the rollout phase scores it, or stops the call once enough groups are in)."""
        for req in requests:
            if req.sampling.stop and self.tokenizer is None:
                raise ValueError(f"request {req.group_id!r} has stop strings {req.sampling.stop} but the local "
                                 f"engine has no tokenizer to decode them")
        rows = [self._new_row(i, j, req) for i, req in enumerate(requests) for j in range(req.sampling.n)]
        seeds = [self._row_seed(req) for req in requests]
        epoch = self._abort_epoch
        with self._lock, torch.inference_mode():
            reporter = _FinishedRequests(requests, rows, self._version, on_request_done)
            for chunk in self._chunks(rows):
                if self._abort_epoch != epoch:
                    for row in chunk:
                        row.finish = "abort"
                    reporter.poll(chunk)
                    continue
                self._decode(requests, chunk, seeds, epoch, reporter)
        return reporter.samples()

    def abort(self) -> None:
        """Ends every generate() call begun before this one (running, or waiting for the model):
        their unfinished samples come back with finish reason 'abort'."""
        self._abort_epoch += 1

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        self.load_weights(named_tensors, version)

    def parameters_missing_from(self, names: set[str]) -> list[str]:
        """The model's parameters (one name per shared storage) that `names` leaves without weights."""
        return sorted(first for first, aliases in self._aliases.items() if not any(a in names for a in aliases))

    def load_weights(self, named_tensors: NamedTensors, version: int) -> WeightLoadReport:
        """update_weights, returning what was loaded (tensors, bytes)."""
        with self._lock:
            report = self._loader.load(fuse_expert_tensors(named_tensors, self.model), require_all=True)
            self._version = int(version)
            self._kept.clear()  # computed with the old weights
        return report

    def release_memory(self) -> None:
        # On CPU only the kept KV is given back: the weights stay.
        with self._lock:
            self._kept.clear()
            if self.device.type == "cuda":
                self.model.to("cpu")
                torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        if self.device.type == "cuda":
            with self._lock:
                self.model.to(self.device)

    def health(self) -> EngineHealth:
        return EngineHealth(True, f"local {type(self.model).__name__} on {self.device}", self._version)

    # ----- decoding ---------------------------------------------------------------------------
    def _new_row(self, request_index: int, sample_index: int, req: GenerationRequest) -> _Row:
        stop_ids = set(req.sampling.stop_token_ids)
        if not req.sampling.ignore_eos:
            stop_ids |= self.eos_token_ids
        return _Row(request_index, sample_index, req.sampling, frozenset(stop_ids))

    def _row_seed(self, req: GenerationRequest) -> int:
        if req.sampling.seed is not None:
            return int(req.sampling.seed)
        return int(torch.randint(0, 2**62, (1,), generator=self._seed_generator))

    def _chunks(self, rows: list[_Row]) -> list[list[_Row]]:
        """Groups rows into batches of at most max_batch_rows, never splitting a request."""
        chunks: list[list[_Row]] = []
        current: list[_Row] = []
        for row in rows:
            starts_request = row.sample_index == 0
            if current and starts_request and len(current) + row.params.n > self.max_batch_rows:
                chunks.append(current)
                current = []
            current.append(row)
        if current:
            chunks.append(current)
        return chunks

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 cache: Any) -> torch.Tensor:
        kwargs: dict[str, Any] = {self._cache_kwarg: cache, "use_cache": True}
        if self._has_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        return out.logits[:, -1].float()

    def _decode(self, requests: Sequence[GenerationRequest], rows: list[_Row], seeds: list[int], epoch: int,
                reporter: "_FinishedRequests") -> None:
        device = self.device
        request_ids = sorted({r.request_index for r in rows})
        slot_of = {req_index: slot for slot, req_index in enumerate(request_ids)}
        prompts = [requests[i].prompt_ids for i in request_ids]
        width = max(len(p) for p in prompts)
        cache, logits, mask = self._prefill(prompts)
        if self._recorder is not None:  # each prompt's positions, shared by its n samples
            prefill = self._recorder.take(len(prompts), width)
            for row in rows:
                row.routed = [prefill[slot_of[row.request_index], width - len(prompts[slot_of[row.request_index]]):]]

        # One prefill per distinct prompt; its cache rows are repeated for the prompt's n samples.
        expand = torch.tensor([slot_of[r.request_index] for r in rows], device=device)
        if len(rows) != len(prompts):
            cache.batch_select_indices(expand)
        logits, mask = logits[expand], mask[expand]
        next_pos = torch.tensor([len(requests[r.request_index].prompt_ids) for r in rows], device=device)
        state = make_state([r.params.temperature for r in rows], [r.params.top_p for r in rows],
                           [r.params.top_k for r in rows],
                           [derive_sample_seed(seeds[r.request_index], r.sample_index) for r in rows], device,
                           min_ps=[r.params.min_p for r in rows])
        wants_support = {id(r): requests[r.request_index].return_support for r in rows}
        batch = list(rows)  # batch position -> row
        stop_window = {id(r): max((len(s) for s in r.params.stop), default=0) + 1 for r in rows}

        while True:
            sampled = sample_tokens(logits, state, [wants_support[id(r)] for r in batch])
            tokens = sampled.tokens
            for row, token, logprob, behaviour, support in zip(batch, tokens.tolist(), sampled.logprobs.tolist(),
                                                               sampled.behaviour.tolist(), sampled.supports):
                if row.finish is not None:
                    continue
                row.response.append(token)
                row.logprobs.append(logprob)
                row.behaviour.append(behaviour)
                if support is not None:
                    row.support.append(support)
                self._check_finished(row, token, stop_window[id(row)])
            if self._abort_epoch != epoch:
                for row in batch:
                    if row.finish is None:
                        row.finish = "abort"
            alive = [i for i, row in enumerate(batch) if row.finish is None]
            if not alive:
                self._keep_kv(requests, batch, range(len(batch)), cache, mask)
                reporter.poll(batch)
                return
            reporter.poll(batch)
            if len(batch) - len(alive) >= _COMPACT_FRACTION * len(batch):
                finished = [i for i, row in enumerate(batch) if row.finish is not None]
                self._keep_kv(requests, batch, finished, cache, mask)
                keep = torch.tensor(alive, device=device)
                cache.batch_select_indices(keep)
                mask, next_pos, tokens = mask[keep], next_pos[keep], tokens[keep]
                state = state.select(alive)
                batch = [batch[i] for i in alive]
            mask = torch.cat([mask, mask.new_ones(len(batch), 1)], dim=1)
            logits = self._forward(tokens[:, None], mask, next_pos[:, None], cache)
            if self._recorder is not None:  # the token just fed: recorded for rows it continues
                step = self._recorder.take(len(batch), 1)
                for row, routes in zip(batch, step):
                    if row.finish is None:
                        row.routed.append(routes)
            next_pos = next_pos + 1

    def _prefill(self, prompts: Sequence[tuple[int, ...]]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """One forward over the prompts, left-padded (each ends at the last column); a prompt that
        continues a kept prefix feeds only its new ids after that prefix's KV, right-aligned in the
        cache part of the mask. Returns the cache, the last position's logits and the attention mask."""
        from transformers import DynamicCache

        kept = [self._kept.longest_prefix_of(p) if self._recorder is None else None for p in prompts]
        for prefix in {k.ids: k for k in kept if k is not None}.values():
            self._kept.discard(prefix.ids)
        cached = [len(k.ids) if k is not None else 0 for k in kept]
        cached_width = max(cached)
        width = max(len(p) - c for p, c in zip(prompts, cached))
        input_ids = torch.zeros(len(prompts), width, dtype=torch.int64)
        mask = torch.zeros(len(prompts), cached_width + width, dtype=torch.int64)
        for slot, (prompt, c) in enumerate(zip(prompts, cached)):
            new = prompt[c:]
            input_ids[slot, width - len(new):] = torch.tensor(new)
            mask[slot, cached_width - c:cached_width] = 1
            mask[slot, cached_width + width - len(new):] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp_(min=0)[:, cached_width:]
        data = None
        if cached_width:
            hit = next(k for k in kept if k is not None)
            data = []
            for layer, (keys, values) in enumerate(hit.layers):
                shape = (len(prompts), keys.shape[0], cached_width, keys.shape[-1])
                layer_keys, layer_values = keys.new_zeros(shape), values.new_zeros(shape)
                for slot, prefix in enumerate(kept):
                    if prefix is not None:
                        layer_keys[slot, :, cached_width - cached[slot]:] = prefix.layers[layer][0]
                        layer_values[slot, :, cached_width - cached[slot]:] = prefix.layers[layer][1]
                data.append((layer_keys, layer_values))
        cache = DynamicCache(data, config=self.model.config)
        return cache, self._forward(input_ids, mask, positions, cache), mask

    def _keep_kv(self, requests: Sequence[GenerationRequest], batch: list[_Row], positions: Sequence[int],
                 cache: Any, mask: torch.Tensor) -> None:
        """Keeps the KV of the finished rows at `positions` whose requests asked for it (keep_kv).
        A row's KV covers its prompt and all of its response but the last id (never fed back); the
        mask's first that many ones are its columns (a finished row still in the batch fed more)."""
        wanted = [i for i in positions if batch[i].finish != "abort" and requests[batch[i].request_index].keep_kv]
        if not wanted or self._recorder is not None or any(getattr(cache, "is_sliding", None) or ()):
            return
        layers = [(kv[0], kv[1]) for kv in cache]
        for i in wanted:
            row = batch[i]
            ids = requests[row.request_index].prompt_ids + tuple(row.response[:-1])
            columns = mask[i].nonzero().squeeze(-1)[:len(ids)]
            self._kept.keep(KeptPrefix(ids, tuple((keys[i][:, columns], values[i][:, columns])
                                                  for keys, values in layers)))

    def _check_finished(self, row: _Row, token: int, stop_window: int) -> None:
        if token in row.stop_ids:
            row.finish, row.matched = "stop", token
        elif row.params.stop and (matched := self._matched_stop_string(row, stop_window)) is not None:
            row.finish, row.matched = "stop", matched
        elif len(row.response) >= row.params.max_new_tokens:
            row.finish = "length"

    def _matched_stop_string(self, row: _Row, window: int) -> str | None:
        # Every token decodes to >= 1 character, so a stop string completed by the newest token
        # lies within the last len(stop) + 1 tokens.
        tail = self.tokenizer.decode(row.response[-window:])
        for stop in row.params.stop:
            if stop in tail:
                return stop
        return None
