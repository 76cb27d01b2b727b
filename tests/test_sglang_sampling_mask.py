"""SGLang 0.5.23's sampling masks (`return_sampling_mask`: each output token's sampling support and
behaviour log-prob) through SGLang's own HTTP app, tokenizer manager and output streamer, with the
harness scheduler running SGLang's sampler code (tests/sglang_harness); the client's payloads and
parsing of them; and /get_weights_by_name with value verification on Llama, whose SGLang model class
has the method (Qwen3's has not: tests/test_sglang.py).

One server for the module (a tiny Llama, deterministic inference, --sampling-mask-max-tokens 30,
--enable-fp32-lm-head); the support reference is SGLang's own
`top_k_top_p_min_p_sampling_from_probs_torch(return_filtered_probs=True)` on float64 probabilities
of the same weights in HF transformers."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from megatron_grpo.rollout.sglang import client as client_module
from megatron_grpo.rollout.sglang.client import SGLangClient
from megatron_grpo.rollout.sglang.engine import EngineOptions, SGLangEngine
from megatron_grpo.rollout.sglang.errors import SGLangError
from megatron_grpo.rollout.sglang.http_json import RetryPolicy, request_json
from megatron_grpo.rollout.sglang.protocol import generate_payloads, parse_generate_response
from megatron_grpo.rollout.sglang.verify import WeightSample, WeightVerificationError, verify_engines
from megatron_grpo.rollout.sglang.weight_sync import EngineTarget, TensorTransport
from megatron_grpo.rollout.types import GenerationRequest, SamplingParams
from tests.sglang_harness.fixtures import launch_servers, server_settings, sglang_python, sglang_sampler_function
from tests.tiny_hf import EOS_ID, PAD_ID, VOCAB_SIZE, char_tokenizer

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
    from transformers import AutoModelForCausalLM

    from megatron_grpo.models.tiny import tiny_hf_config

    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = tiny_hf_config("llama", vocab_size=VOCAB_SIZE, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                            bos_token_id=None, num_hidden_layers=2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if name.endswith("norm.weight")
                        else 0.4 * torch.randn_like(param))
    model.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder, model.eval()


@pytest.fixture(scope="module")
def server(llama, tmp_path_factory):
    sglang_python()
    settings = server_settings(llama[0], extra_args=("--sampling-mask-max-tokens", str(MASK_CAP),
                                                     "--enable-fp32-lm-head"))
    launcher = launch_servers(tmp_path_factory.mktemp("logs"), [settings])
    yield settings.url
    launcher.shutdown(grace_s=5)


def reference_supports(float64_model, sample, params: SamplingParams):
    """Per response token: SGLang's support set and log(p_y / sum_S p), from float64 probabilities."""
    sample_fn = sglang_sampler_function("top_k_top_p_min_p_sampling_from_probs_torch")
    ids = torch.tensor([list(sample.prompt_ids) + list(sample.response_ids)])
    with torch.no_grad():
        logits = float64_model(input_ids=ids).logits[0, len(sample.prompt_ids) - 1:-1]
    probs = torch.softmax(logits / params.temperature, dim=-1)
    rows = len(sample.response_ids)
    _, weights, token_ids, _ = sample_fn(
        probs.clone(), torch.full((rows,), params.top_k), torch.full((rows,), params.top_p, dtype=torch.float64),
        torch.full((rows,), params.min_p, dtype=torch.float64), params.min_p > 0, None, torch.arange(rows),
        return_filtered_probs=True)
    supports = [set(token_ids[i][weights[i] > 0].tolist()) for i in range(rows)]
    behaviour = [math.log(probs[i, y].item() / probs[i, sorted(s)].sum().item())
                 for i, (y, s) in enumerate(zip(sample.response_ids, supports))]
    return supports, behaviour


@pytest.mark.slow
def test_truncated_sampling_returns_sglangs_support_and_behaviour_logprobs(server, llama):
    """Each token's support is the set SGLang's torch sampler keeps (top-k and top-p cuts both
    binding somewhere), contains the token, and its behaviour log-prob is log(p_y / sum_S p)."""
    model = copy.deepcopy(llama[1]).double()
    cases = [truncated(20, 0.9, n=2), truncated(MASK_CAP, 0.5, seed=11), truncated(MASK_CAP, 0.99, seed=5)]
    client = SGLangClient([server], retry=FAST_RETRY)
    requests = [GenerationRequest(PROMPTS[i], params, f"g{i}", return_support=True) for i, params in enumerate(cases)]
    samples = client.generate(requests)
    assert len(samples) == 4 and {s.engine for s in samples} == {server}
    sizes = set()
    for sample, params in zip(samples, [cases[0], cases[0], cases[1], cases[2]]):
        assert len(sample.response_ids) == len(sample.sampling_support) == len(sample.behaviour_logprobs) > 0
        supports, behaviour = reference_supports(model, sample, params)
        tolerance = 64 * torch.finfo(torch.float32).eps * (len(sample.prompt_ids) + len(sample.response_ids))
        for position, (token, got, want) in enumerate(zip(sample.response_ids, sample.sampling_support, supports)):
            assert token in got and len(got) == len(set(got)), (sample.group_id, position)
            assert set(got) == want, (sample.group_id, position, sorted(set(got) ^ want))
            sizes.add(len(got))
        torch.testing.assert_close(torch.tensor(sample.behaviour_logprobs, dtype=torch.float64),
                                   torch.tensor(behaviour, dtype=torch.float64), atol=tolerance, rtol=0)
        # the truncated distribution is a renormalised part of the full one: its log-probs are larger
        assert all(b >= f - tolerance for b, f in zip(sample.behaviour_logprobs, sample.logprobs))
    assert 20 in sizes and MASK_CAP in sizes and min(sizes) < 20, sizes  # top-k cut, top-p cut
    # greedy: SGLang samples it as top_k=1, the support is the token, its behaviour log-prob 0
    [greedy] = client.generate([GenerationRequest(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=6),
                                                  "greedy", return_support=True)])
    assert greedy.sampling_support == [[t] for t in greedy.response_ids] and set(greedy.behaviour_logprobs) == {0.0}
    client.close()


@pytest.mark.slow
def test_sglang_refuses_masks_it_cannot_build(server, monkeypatch):
    """SGLang refuses a mask without a finite top_k <= its cap (HTTP 400, the scheduler's check), and
    aborts a request whose support outgrows the cap (HTTP 400): one clear error, not retried."""
    client = SGLangClient([server], retry=FAST_RETRY)
    body = {"input_ids": [5, 6], "return_logprob": True, "return_sampling_mask": True,
            "sampling_params": {"top_k": -1, "top_p": 0.9, "max_new_tokens": 2}}
    with pytest.raises(SGLangError, match=rf"HTTP 400: .*return_sampling_mask requires top_k=1 for greedy sampling "
                                          rf"or finite 1 < top_k <= {MASK_CAP}; got top_k=1073741824") as refused:
        client.call(server, "/generate", body)
    assert refused.value.status == 400
    with pytest.raises(SGLangError, match="top_k=-1"):  # the client does not even send it
        client.generate([GenerationRequest((5, 6), truncated(-1, 0.9), "none", return_support=True)])
    over = GenerationRequest((5, 6), truncated(MASK_CAP + 1, 1.0), "over", return_support=True)
    with pytest.raises(SGLangError, match=rf"{server}/generate refused the sampling mask of request 'over' "
                                          rf"\(top_k={MASK_CAP + 1}, .*set rollout.top_k to a finite value .*"
                                          rf"got top_k={MASK_CAP + 1}") as refused:
        client.generate([over])
    assert refused.value.status == 400

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


@pytest.mark.slow
def test_get_weights_by_name_and_value_verification_on_llama(server, llama):
    """SGLang's Llama answers /get_weights_by_name (its Qwen2/Qwen3 do not), so value verification
    runs: it names a tensor the engine skipped (SGLang's load_weights ignores unknown names) and
    one whose values differ."""
    model = llama[1]
    assert request_json(server, "/server_info", method="GET")["enable_fp32_lm_head"] is True  # accepted
    rows = request_json(server, "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 3})
    assert rows == model.state_dict()["model.norm.weight"][:3].tolist()
    client = SGLangClient([server])
    engine = SGLangEngine(client, TensorTransport(client, [EngineTarget(server)]),
                          options=EngineOptions(health_check_interval_s=0))
    # the same weights (the engine keeps serving the reference), one under a name the model lacks
    renamed = ((name.replace("model.norm.weight", "model.final_norm.weight"), tensor.clone())
               for name, tensor in model.state_dict().items())
    with pytest.raises(WeightVerificationError, match=rf"{server} has no parameter 'model.final_norm.weight'"):
        engine.update_weights(renamed, version=1)
    sample = WeightSample()
    list(sample.tap((name, tensor) for name, tensor in model.state_dict().items()))
    assert verify_engines(client, [EngineTarget(server)], sample).value_checked == len(sample.tensors) > 3
    sample.tensors["lm_head.weight"] = sample.tensors["lm_head.weight"] + 1.0
    with pytest.raises(WeightVerificationError, match=rf"{server} holds different values for 'lm_head.weight'"):
        verify_engines(client, [EngineTarget(server)], sample)
    client.close()
