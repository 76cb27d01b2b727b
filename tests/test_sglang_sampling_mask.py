"""SGLang 0.5.23's sampling masks (`return_sampling_mask`: each output token's sampling support and
behaviour log-prob): the client's payloads and parsing of them, and a support that outgrows the
server's cap, which only the harness can make happen on demand (its per-request fault; a real
engine's support outgrows the cap only on ties at the cut-off).

The supports and behaviour log-probs themselves, SGLang's refusals of a top_k it cannot mask, and
/get_weights_by_name with value verification on Llama run against SGLang's own runtime
(tests/test_sglang_runtime.py)."""
from __future__ import annotations


import pytest

from megatron_grpo.rollout.sglang import client as client_module
from megatron_grpo.rollout.sglang.client import SGLangClient
from megatron_grpo.rollout.sglang.errors import SGLangError
from megatron_grpo.rollout.sglang.http_json import RetryPolicy
from megatron_grpo.rollout.sglang.protocol import generate_payloads, parse_generate_response
from megatron_grpo.rollout.types import GenerationRequest, SamplingParams
from tests.sglang_harness.fixtures import launch_servers, server_settings, sglang_python
from tests.tiny_hf import save_peaky_llama

MASK_CAP = 30  # the server's --sampling-mask-max-tokens
FAST_RETRY = RetryPolicy(max_attempts=3, backoff_s=0.05)
PROMPTS = [(5, 9, 11), (40, 41, 42, 43, 44), (7,) * 9]


def truncated(top_k: int, top_p: float, seed: int = 3, n: int = 1, **kw) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, top_k=top_k, top_p=top_p, max_new_tokens=12, seed=seed, **kw)


# ----- payloads and parsing (no server) -----------------------------------------------------------
def test_payloads_ask_for_masks_only_where_sglang_gives_them():
    def payload(params, support=False):
        return generate_payloads(GenerationRequest((5, 6), params, "g", return_support=support))[0][1]

    plain = payload(SamplingParams(top_p=0.9, min_p=0.05))
    assert plain["sampling_params"]["min_p"] == 0.05 and "return_sampling_mask" not in plain  # top_k=-1: none
    for params, support in ((truncated(20, 1.0), False), (truncated(20, 0.9), True),
                            (SamplingParams(temperature=0.0), True), (truncated(5000, 1.0), True)):
        asked = payload(params, support)
        assert asked["return_sampling_mask"] is True and asked["sampling_logprobs_mode"] == "selected", params
    # was: n>1 sent as one request; SGLang first sends its prompt alone to cache the prefix, and that
    # warm-up, which samples nothing, fails the request with HTTP 500 (tests/test_sglang_runtime.py)
    fanned = generate_payloads(GenerationRequest((5, 6), truncated(20, 1.0, seed=None, n=3), "g"))
    assert [(first, p["sampling_params"]["n"], "sampling_seed" in p["sampling_params"], p["return_sampling_mask"])
            for first, p in fanned] == [(0, 1, False, True), (1, 1, False, True), (2, 1, False, True)]
    unmasked = generate_payloads(GenerationRequest((5, 6), SamplingParams(n=3, top_p=0.9), "u"))
    assert len(unmasked) == 1 and unmasked[0][1]["sampling_params"]["n"] == 3  # no mask: SGLang's n fan-out
    # above SGLang's default cap only when supports are needed (a default server refuses the request)
    assert "return_sampling_mask" not in payload(truncated(5000, 1.0))
    assert "return_sampling_mask" not in payload(SamplingParams(temperature=0.0))  # greedy, no supports asked
    with pytest.raises(SGLangError, match=r"request 'g' needs each token's sampling support .* top_k=-1.*set "
                                          r"rollout.top_k to a finite value <= 4096, or rollout.sampling_replay=off"):
        payload(SamplingParams(top_p=0.9), support=True)


def _answer(output_ids, masks=None, values=None, finish="length"):
    meta = {"finish_reason": {"type": finish}, "weight_version": "3",
            "output_token_logprobs": [[-1.0, t, None] for t in output_ids]}
    if masks is not None:
        meta["output_token_sampling_mask"] = masks
    if values is not None:
        meta["output_token_sampling_logprobs"] = values
    return {"output_ids": output_ids, "meta_info": meta}


def test_parse_reads_and_checks_the_mask_fields():
    request = GenerationRequest((5,), truncated(3, 1.0), "g", return_support=True)
    where = "http://e:1/generate"
    [sample] = parse_generate_response(_answer([7, 8], [[7, 2, 3], [9, 8]], [-0.5, -0.25]), request, where,
                                       engine="http://e:1")
    assert sample.behaviour_logprobs == [-0.5, -0.25] and sample.sampling_support == [[7, 2, 3], [9, 8]]
    assert sample.sampled_logprobs == [-0.5, -0.25] and sample.logprobs == [-1.0, -1.0]
    assert sample.engine == "http://e:1" and sample.weight_version == 3
    no_support = GenerationRequest((5,), truncated(3, 1.0), "h")
    [sample] = parse_generate_response(_answer([7], [[7, 2]], [-0.5]), no_support, where)
    assert sample.behaviour_logprobs == [-0.5] and sample.sampling_support is None
    for body, error in ((_answer([7, 8], [[7]], [-0.5]), r"2 output_ids but 1 output_token_sampling_logprobs and "
                                                         r"1 output_token_sampling_mask rows for 'g'"),
                        (_answer([7], [[2, 3]], [-0.5]), r"output_token_sampling_mask\[0\] \(2 ids\) does not contain "
                                                         r"the sampled token 7 \('g'\)"),
                        (_answer([7], [[7]], [0.5]), r"output_token_sampling_logprobs\[0\] = 0.5 for 'g' is not"),
                        (_answer([7]), r"no output_token_sampling_mask for 'g' although it asked .*sglang-router "
                                       r"0.3.2 .*rollout.sglang.router=false.*rollout.sampling_replay=off")):
        with pytest.raises(SGLangError, match=rf"^{where}: {error}"):
            parse_generate_response(body, request, where)
    # aborted in SGLang's queue, or a server that drops the flag while no supports are needed: unknown
    [aborted] = parse_generate_response(_answer([7], finish="abort"), request, where)
    [dropped] = parse_generate_response(_answer([7]), no_support, where)
    assert (aborted.behaviour_logprobs, aborted.sampling_support, dropped.behaviour_logprobs) == (None, None, None)


# ----- against SGLang's code ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama (SGLang's LlamaForCausalLM has get_weights_by_name) with the character tokenizer;
    weights large enough that top-p cuts the distributions at different sizes."""
    folder = tmp_path_factory.mktemp("llama")
    return folder, save_peaky_llama(folder)


@pytest.fixture(scope="module")
def server(llama, tmp_path_factory):
    sglang_python()
    settings = server_settings(llama[0], extra_args=("--sampling-mask-max-tokens", str(MASK_CAP)))
    launcher = launch_servers(tmp_path_factory.mktemp("logs"), [settings])
    yield settings.url
    launcher.shutdown(grace_s=5)


@pytest.mark.slow
def test_a_support_wider_than_the_cap_is_one_clear_error(server, monkeypatch):
    """SGLang aborts a request whose support outgrows --sampling-mask-max-tokens (HTTP 400): one
    clear error, not retried, the engine not blamed."""
    client = SGLangClient([server], retry=FAST_RETRY)

    def with_support_cap_fault(request):  # the harness's per-request fault: supports wider than 3 overflow
        return [(first, {**payload, "sampling_params": {**payload["sampling_params"],
                                                        "custom_params": {"harness_sampler_support_cap": 3}}})
                for first, payload in generate_payloads(request)]

    monkeypatch.setattr(client_module, "generate_payloads", with_support_cap_fault)
    with pytest.raises(SGLangError, match=rf"refused the sampling mask of request 'g0' .*lower rollout.top_k .*"
                                          rf"SGLang said: .*HTTP 400: .*Sampling support exceeds "
                                          rf"--sampling-mask-max-tokens={MASK_CAP}") as overflow:
        client.generate([GenerationRequest(PROMPTS[0], truncated(20, 1.0), "g0", return_support=True)])
    # not retried, the engine not blamed
    assert overflow.value.status == 400 and not client.rotation.is_dead(client.urls[0])
    monkeypatch.undo()
    assert client.generate([GenerationRequest(PROMPTS[0], truncated(20, 1.0), "after")])[0].behaviour_logprobs
    client.close()

