"""SGLang /generate payloads from GenerationRequests, and Samples from its answers (sglang 0.5 schema).

Truncated sampling (top-p / top-k / min-p): the request asks for SGLang's sampling mask
(`return_sampling_mask`, `sampling_logprobs_mode="selected"`, SGLang 0.5.23), which gives per output
token the ids the sampler could draw (`meta_info["output_token_sampling_mask"]`) and the log-prob of
the drawn token in that truncated, renormalised distribution (`["output_token_sampling_logprobs"]`):
`Sample.behaviour_logprobs`, and `Sample.sampling_support` when the request asks for supports. SGLang
builds the mask only for top_k == 1 or 1 < top_k <= its --sampling-mask-max-tokens (default 4096;
anything else is refused with HTTP 400), so without a finite top_k no mask is asked for (and a request
that needs supports fails here, before anything is sent); a support larger than that cap (ties at the
cut-off) aborts the request with HTTP 400, which the client reports without retrying
(`sampling_mask_error`).

Routing replay (GenerationRequest.routed_experts_shape): the request asks for
`return_routed_experts` (SGLang 0.5.23, io_struct.GenerateReqInput; `routed_experts_start_len` left at
0: the whole sequence). A server started with `--enable-return-routed-experts` answers, per sample, in
`meta_info["routed_experts"]`: base64 of int32 [len(prompt) + len(output) - 1, num_hidden_layers,
num_experts_per_tok] in C order (its scheduler's `_maybe_collect_routed_experts` reads positions
[0, seqlen - 1) of its capture buffer; the detokenizer base64-encodes `tensor.numpy().tobytes()`),
logical expert ids, 0 on dense layers. Without the server flag SGLang ignores the request field
(no key in meta_info); a missing key is an error here (`_parse_routed_experts`)."""
from __future__ import annotations

import base64
import binascii
import logging
import math
from typing import Any

import numpy as np

from megatron_grpo.rollout.sglang.errors import SGLangError
from megatron_grpo.rollout.types import GenerationRequest, Sample, SamplingParams, derive_sample_seed

log = logging.getLogger(__name__)

# SGLang's default --sampling-mask-max-tokens (sglang/srt/arg_groups/fields/exec_.py): the largest top_k it
# returns masks for.
SGLANG_SAMPLING_MASK_MAX_TOKENS = 4096
_WARNED_NO_MASK: set[str] = set()  # servers already named in the warning of _parse_sampling_mask


def sampling_params_payload(params: SamplingParams, n: int, seed: int | None) -> dict[str, Any]:
    payload: dict[str, Any] = {"n": n, "temperature": params.temperature, "top_p": params.top_p,
                               "top_k": params.top_k, "min_p": params.min_p, "max_new_tokens": params.max_new_tokens,
                               "stop": list(params.stop), "stop_token_ids": list(params.stop_token_ids),
                               "ignore_eos": params.ignore_eos}
    if seed is not None:
        payload["sampling_seed"] = seed
    return payload


def generate_payloads(request: GenerationRequest) -> list[tuple[int, dict[str, Any]]]:
    """The HTTP requests for all n samples of a prompt, each with the index of its first sample.

    Unseeded: one request with `n` (SGLang fans it out and shares the prompt's prefix cache).
    Seeded: one n=1 request per sample with its derived seed, because SGLang gives all n samples
    of one request the same `sampling_seed` (identical samples), and sglang-router refuses the
    batched alternative (a list of sampling_params: 422). With a sampling mask: one n=1 request per
    sample too, because SGLang 0.5.23 first sends an n>1 request's prompt alone (max_new_tokens=0,
    to cache its prefix), that warm-up samples nothing, so no mask, and the request fails with HTTP
    500 "The sampling backend did not return captured sampling support"."""
    params = request.sampling
    base = {"input_ids": list(request.prompt_ids), "return_logprob": True, "logprob_start_len": -1}
    if wants_sampling_mask(request):
        base.update(return_sampling_mask=True, sampling_logprobs_mode="selected")
    if request.routed_experts_shape is not None:
        base["return_routed_experts"] = True
    if params.seed is None and not base.get("return_sampling_mask"):
        return [(0, {**base, "sampling_params": sampling_params_payload(params, params.n, None)})]
    return [(j, {**base, "sampling_params": sampling_params_payload(
        params, 1, None if params.seed is None else derive_sample_seed(params.seed, j))}) for j in range(params.n)]


def wants_sampling_mask(request: GenerationRequest) -> bool:
    """Whether to ask SGLang for each token's sampling support and behaviour log-prob.

    Truncated sampling with a finite top_k asks (for the behaviour log-probs; only up to SGLang's
    default cap unless the request needs supports: a server with the default cap would refuse the
    whole request); greedy asks when supports are needed (SGLang samples it as top_k=1: the support
    is the token). A request that needs supports without a finite top_k cannot get them: SGLangError."""
    params = request.sampling
    if not (params.truncated or request.return_support):
        return False
    if params.greedy:
        return True
    if params.top_k == -1:
        if request.return_support:
            raise SGLangError(
                f"request {request.group_id!r} needs each token's sampling support (rollout.sampling_replay), but "
                f"samples with top_k=-1: SGLang returns supports (return_sampling_mask) only for a finite top_k <= "
                f"its --sampling-mask-max-tokens (default {SGLANG_SAMPLING_MASK_MAX_TOKENS}); set rollout.top_k to a "
                f"finite value <= {SGLANG_SAMPLING_MASK_MAX_TOKENS}, or rollout.sampling_replay=off")
        return False
    return request.return_support or params.top_k <= SGLANG_SAMPLING_MASK_MAX_TOKENS


def sampling_mask_error(error: SGLangError, request: GenerationRequest, url: str) -> SGLangError | None:
    """SGLang's refusal of a request's sampling mask (HTTP 400: top_k outside what it can mask, or a
    support larger than --sampling-mask-max-tokens; 500: the sampler's support was unusable) as
    one clear error, or None for any other error. Not retried: the same request on another engine
    meets the same limit, and the engine is not at fault."""
    text = str(error)
    if error.status not in (400, 500) or not any(key in text.lower() for key in ("sampling support",
                                                                                   "return_sampling_mask")):
        return None
    hint = ("lower rollout.top_k (ties at the cut-off can widen a support past it), raise the servers' "
            "--sampling-mask-max-tokens, or set rollout.sampling_replay=off" if "exceeds" in text
            else "set rollout.top_k to a finite value <= the servers' --sampling-mask-max-tokens "
                 f"(default {SGLANG_SAMPLING_MASK_MAX_TOKENS}), or rollout.sampling_replay=off"
            if error.status == 400 else "this is an SGLang sampler error, not a setting")
    return SGLangError(f"{url}/generate refused the sampling mask of request {request.group_id!r} "
                       f"(top_k={request.sampling.top_k}, top_p={request.sampling.top_p}, "
                       f"min_p={request.sampling.min_p}): {hint}. SGLang said: {text}", url, error.status)


def parse_weight_version(value: Any, where: str) -> int:
    """SGLang reports weight_version as a string; "default" is the checkpoint loaded at launch (0)."""
    if value is None or value == "default":
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise SGLangError(f"{where}: weight_version {value!r} is not an integer (this trainer stamps "
                          f"integer versions)") from None


def parse_generate_response(body: Any, request: GenerationRequest, where: str, first_index: int = 0,
                            count: int | None = None, engine: str = "") -> list[Sample]:
    """Samples `first_index .. first_index + count - 1` of `request` from one /generate answer;
    `engine` (the server's URL) goes into each Sample."""
    count = request.sampling.n if count is None else count
    items = body if isinstance(body, list) else [body]
    if len(items) != count:
        raise SGLangError(f"{where}: expected {count} outputs for request {request.group_id!r}, got {len(items)}")
    mask = wants_sampling_mask(request)
    return [_parse_item(item, request, first_index + j, where, engine, mask) for j, item in enumerate(items)]


def _parse_item(item: Any, request: GenerationRequest, index: int, where: str, engine: str, mask: bool) -> Sample:
    try:
        meta = item["meta_info"]
        output_ids = [int(t) for t in item["output_ids"]]
        logprob_rows = meta.get("output_token_logprobs") or []
        finish = meta.get("finish_reason") or {}
    except (KeyError, TypeError) as exc:
        raise SGLangError(f"{where}: malformed /generate output for {request.group_id!r}: missing {exc}") from None
    finish_type = finish.get("type") if isinstance(finish, dict) else finish
    if finish_type not in ("stop", "length", "abort"):
        raise SGLangError(f"{where}: unknown finish_reason {finish!r} for {request.group_id!r}")
    if len(logprob_rows) != len(output_ids):
        raise SGLangError(f"{where}: {len(output_ids)} output_ids but {len(logprob_rows)} output_token_logprobs "
                          f"for {request.group_id!r} (was return_logprob honoured?)")
    logprobs = []
    for position, (row, token) in enumerate(zip(logprob_rows, output_ids)):
        if int(row[1]) != token:
            raise SGLangError(f"{where}: output_token_logprobs[{position}] is for token {row[1]}, output_ids has "
                              f"{token} ({request.group_id!r})")
        logprobs.append(float(row[0]))
    behaviour, support = (_parse_sampling_mask(meta, output_ids, request, where, finish_type == "abort")
                          if mask else (None, None))
    routes = (_parse_routed_experts(meta, len(output_ids), request, where, finish_type == "abort")
              if request.routed_experts_shape is not None else None)
    return Sample(group_id=request.group_id, sample_index=index, prompt_ids=list(request.prompt_ids),
                  response_ids=output_ids, logprobs=logprobs, finish_reason=finish_type,
                  weight_version=parse_weight_version(meta.get("weight_version"), where),
                  matched_stop=finish.get("matched") if isinstance(finish, dict) else None,
                  routed_experts=routes, behaviour_logprobs=behaviour, sampling_support=support, engine=engine)


def _parse_routed_experts(meta: dict, num_output: int, request: GenerationRequest, where: str,
                          aborted: bool) -> np.ndarray | None:
    """int32 [len(prompt) + num_output - 1, num_layers, top_k] from SGLang's `meta_info["routed_experts"]`.

    Missing where a request was aborted before it finished in SGLang (its samples are dropped or
    resubmitted anyway): None. Missing otherwise: the server runs without
    --enable-return-routed-experts (SGLang then ignores return_routed_experts), or a router in front
    of it dropped the field (sglang-router 0.3.2 does): an error naming both."""
    value = meta.get("routed_experts")
    if value is None:
        if aborted:
            return None
        raise SGLangError(f"{where}: no routed_experts for {request.group_id!r} although it asked for them "
                          f"(return_routed_experts, actor.moe_routing_replay=true): start the SGLang servers with "
                          f"--enable-return-routed-experts (without it SGLang ignores the request), and send "
                          f"/generate to the engines directly, not through sglang-router (0.3.2 drops the field)")
    layers, top_k = request.routed_experts_shape
    positions = len(request.prompt_ids) + num_output - 1
    try:
        flat = np.frombuffer(base64.b64decode(value, validate=True), dtype=np.int32)
    except (binascii.Error, TypeError, ValueError) as exc:
        raise SGLangError(f"{where}: routed_experts of {request.group_id!r} is not base64 of int32: {exc}") from None
    if flat.size != positions * layers * top_k:
        raise SGLangError(f"{where}: routed_experts of {request.group_id!r} holds {flat.size} ids, expected "
                          f"{positions} positions (prompt + output - 1) x {layers} layers x top-{top_k} = "
                          f"{positions * layers * top_k} (does the server serve this model?)")
    return flat.reshape(positions, layers, top_k).copy()  # writable, and owns its memory


def _parse_sampling_mask(meta: dict, output_ids: list[int], request: GenerationRequest, where: str,
                         aborted: bool) -> tuple[list[float] | None, list[list[int]] | None]:
    """(behaviour log-probs, supports or None) from SGLang's sampling-mask fields.

    They are missing where a request was aborted in SGLang's queue (its samples are dropped or
    resubmitted anyway), and where the server is older than SGLang 0.5.23 or a router in front of
    it drops `return_sampling_mask` (sglang-router 0.3.2 does): a request that needs supports then
    fails; otherwise its behaviour log-probs are unknown (None, with one warning per server)."""
    values = meta.get("output_token_sampling_logprobs")
    masks = meta.get("output_token_sampling_mask")
    if values is None and masks is None:
        if aborted or not output_ids:
            return None, None
        if request.return_support:
            raise SGLangError(f"{where}: no output_token_sampling_mask for {request.group_id!r} although it asked "
                              f"for one (return_sampling_mask): the server is older than SGLang 0.5.23, or a router "
                              f"in front of it drops the field (sglang-router 0.3.2 does): send /generate to the "
                              f"engines directly (rollout.sglang.router=false), or set rollout.sampling_replay=off")
        if where not in _WARNED_NO_MASK:
            _WARNED_NO_MASK.add(where)
            log.warning("%s answers without sampling masks (an SGLang older than 0.5.23, or a router that drops "
                        "return_sampling_mask): the behaviour log-probs of its truncated samples are unknown, "
                        "their full-distribution log-probs stand in", where)
        return None, None
    if not isinstance(values, list) or not isinstance(masks, list):
        raise SGLangError(f"{where}: malformed output_token_sampling_logprobs / output_token_sampling_mask for "
                          f"{request.group_id!r}: {type(values).__name__} / {type(masks).__name__}")
    if len(values) != len(output_ids) or len(masks) != len(output_ids):
        raise SGLangError(f"{where}: {len(output_ids)} output_ids but {len(values)} output_token_sampling_logprobs "
                          f"and {len(masks)} output_token_sampling_mask rows for {request.group_id!r}")
    behaviour = []
    for position, value in enumerate(values):  # sampling_logprobs_mode="selected": one number per token
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value > 0:
            raise SGLangError(f"{where}: output_token_sampling_logprobs[{position}] = {value} for "
                              f"{request.group_id!r} is not a log-probability")
        behaviour.append(float(value))
    if not request.return_support:
        return behaviour, None
    supports = []
    for position, (row, token) in enumerate(zip(masks, output_ids)):
        ids = [int(t) for t in row]
        if token not in ids:
            raise SGLangError(f"{where}: output_token_sampling_mask[{position}] ({len(ids)} ids) does not contain "
                              f"the sampled token {token} ({request.group_id!r})")
        supports.append(ids)
    return behaviour, supports
