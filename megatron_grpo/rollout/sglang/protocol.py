"""SGLang /generate payloads from GenerationRequests, and Samples from its answers (sglang 0.5 schema)."""
from __future__ import annotations

from typing import Any

from megatron_grpo.rollout.sglang.errors import SGLangError
from megatron_grpo.rollout.types import GenerationRequest, Sample, SamplingParams, derive_sample_seed


def sampling_params_payload(params: SamplingParams, n: int, seed: int | None) -> dict[str, Any]:
    payload: dict[str, Any] = {"n": n, "temperature": params.temperature, "top_p": params.top_p,
                               "top_k": params.top_k, "max_new_tokens": params.max_new_tokens,
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
    batched alternative (a list of sampling_params: 422)."""
    params = request.sampling
    base = {"input_ids": list(request.prompt_ids), "return_logprob": True, "logprob_start_len": -1}
    if params.seed is None:
        return [(0, {**base, "sampling_params": sampling_params_payload(params, params.n, None)})]
    return [(j, {**base, "sampling_params": sampling_params_payload(params, 1, derive_sample_seed(params.seed, j))})
            for j in range(params.n)]


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
                            count: int | None = None) -> list[Sample]:
    """Samples `first_index .. first_index + count - 1` of `request` from one /generate answer."""
    count = request.sampling.n if count is None else count
    items = body if isinstance(body, list) else [body]
    if len(items) != count:
        raise SGLangError(f"{where}: expected {count} outputs for request {request.group_id!r}, got {len(items)}")
    return [_parse_item(item, request, first_index + j, where) for j, item in enumerate(items)]


def _parse_item(item: Any, request: GenerationRequest, index: int, where: str) -> Sample:
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
    return Sample(group_id=request.group_id, sample_index=index, prompt_ids=list(request.prompt_ids),
                  response_ids=output_ids, logprobs=logprobs, finish_reason=finish_type,
                  weight_version=parse_weight_version(meta.get("weight_version"), where),
                  matched_stop=finish.get("matched") if isinstance(finish, dict) else None)
