"""LocalEngine: sampling, stop handling, log-probs vs a full forward pass, seeding, weight updates."""
from __future__ import annotations

import threading

import pytest
import torch

from megatron_grpo.rollout.local import LocalEngine
from megatron_grpo.rollout.sampling import make_state, sample_tokens
from megatron_grpo.rollout.types import GenerationRequest, SamplingParams
from megatron_grpo.rollout.weights import WeightUpdateError
from tests.tiny_hf import EOS_ID, char_tokenizer, float64_logprobs, tiny_model

PROMPTS = [(5, 9, 11), (40, 41, 42, 43, 44, 45, 46), (7,) * 12]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0, scale=3.0)


@pytest.fixture(scope="module")
def engine(model):
    return LocalEngine(model, char_tokenizer())


def requests_for(params: SamplingParams, prompts=PROMPTS):
    return [GenerationRequest(p, params, group_id=f"g{i}") for i, p in enumerate(prompts)]


def recompute_logprobs(model, prompt, response, temperature):
    """Reference: one forward pass over the whole unpadded sequence, no KV cache."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    scale = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / scale, -1)
    return logp, logp.gather(1, torch.tensor(response)[:, None]).squeeze(1)


def test_n_samples_per_prompt_in_request_order(engine):
    out = engine.generate(requests_for(SamplingParams(n=3, max_new_tokens=6, seed=4, ignore_eos=True)))
    assert [(s.group_id, s.sample_index) for s in out] == [(f"g{i}", j) for i in range(3) for j in range(3)]
    for s in out:
        assert s.prompt_ids == list(PROMPTS[int(s.group_id[1:])])
        assert len(s.response_ids) == len(s.logprobs) == 6 and s.finish_reason == "length"
    # the n samples of a seeded request differ from each other
    assert len({tuple(s.response_ids) for s in out[:3]}) == 3


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, -1), (0.7, 1.0, -1), (1.3, 0.8, -1),
                                                     (1.0, 1.0, 20), (0.0, 1.0, -1)])
def test_logprobs_equal_full_forward_recomputation(engine, model, temperature, top_p, top_k):
    params = SamplingParams(n=2, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=12, seed=7)
    for s in engine.generate(requests_for(params)):
        logp, ref = recompute_logprobs(model, s.prompt_ids, s.response_ids, temperature)
        torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-5, rtol=0)
        # the sampled tokens respect the filters (checked on the reference distribution)
        ranks = (logp > logp.gather(1, torch.tensor(s.response_ids)[:, None])).sum(-1)
        if top_k > 0:
            assert int(ranks.max()) < top_k
        if top_p < 1.0:
            probs = logp.exp()
            chosen = probs.gather(1, torch.tensor(s.response_ids)[:, None]).squeeze(1)
            mass_before = (probs * (probs > chosen[:, None])).sum(-1)
            assert bool((mass_before <= top_p + 1e-6).all())


def test_greedy_equals_argmax_decoding(engine, model):
    out = engine.generate(requests_for(SamplingParams(temperature=0.0, max_new_tokens=10)))
    for s in out:
        ids = list(s.prompt_ids)
        with torch.no_grad():
            for _ in range(10):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert s.response_ids == ids[len(s.prompt_ids):]


def test_top_k_1_and_tiny_top_p_are_greedy(engine):
    greedy = engine.generate(requests_for(SamplingParams(temperature=0.0, max_new_tokens=8)))
    for params in (SamplingParams(top_k=1, max_new_tokens=8, seed=3),
                   SamplingParams(top_p=1e-6, max_new_tokens=8, seed=3)):
        assert [s.response_ids for s in engine.generate(requests_for(params))] == [s.response_ids for s in greedy]


def test_same_seed_same_samples_independent_of_batch(engine):
    params = SamplingParams(n=2, max_new_tokens=10, seed=123)
    first = engine.generate(requests_for(params))
    second = engine.generate(requests_for(params))
    assert [s.response_ids for s in first] == [s.response_ids for s in second]
    alone = engine.generate([GenerationRequest(PROMPTS[1], params, "g1")])
    assert [s.response_ids for s in alone] == [s.response_ids for s in first[2:4]]
    other = engine.generate(requests_for(SamplingParams(n=2, max_new_tokens=10, seed=124)))
    assert [s.response_ids for s in other] != [s.response_ids for s in first]


def test_stop_token_ids_and_max_length(engine):
    stop_ids = tuple(range(100, 130))  # a tenth of the vocabulary: some rows stop, some do not
    out = engine.generate(requests_for(SamplingParams(n=4, max_new_tokens=8, stop_token_ids=stop_ids, seed=1)))
    reasons = {s.finish_reason for s in out}
    assert reasons == {"stop", "length"}
    for s in out:
        if s.finish_reason == "stop":
            assert s.response_ids[-1] in stop_ids and s.matched_stop == s.response_ids[-1]
            assert not set(s.response_ids[:-1]) & set(stop_ids)
        else:
            assert len(s.response_ids) == 8 and not set(s.response_ids) & set(stop_ids)


def test_eos_stops_unless_ignored(model):
    eos_ids = list(range(100, 130)) + [EOS_ID]
    eng = LocalEngine(model, char_tokenizer(), eos_token_ids=eos_ids)
    params = SamplingParams(n=4, max_new_tokens=8, seed=1)
    stopped = eng.generate(requests_for(params))
    assert any(s.finish_reason == "stop" and s.response_ids[-1] in eos_ids for s in stopped)
    ignored = eng.generate(requests_for(SamplingParams(n=4, max_new_tokens=8, seed=1, ignore_eos=True)))
    assert all(s.finish_reason == "length" and len(s.response_ids) == 8 for s in ignored)
    # the default EOS comes from the model config
    assert LocalEngine(model).eos_token_ids == frozenset({EOS_ID})


def test_stop_strings(engine):
    tok = engine.tokenizer
    stops = ("a", "e", "K", "7", "xy")
    out = engine.generate(requests_for(SamplingParams(n=4, max_new_tokens=40, stop=stops, seed=2)))
    assert any(s.finish_reason == "stop" for s in out)
    for s in out:
        text = tok.decode(s.response_ids)
        earlier = tok.decode(s.response_ids[:-1])
        assert not any(stop in earlier for stop in stops)  # it stopped at the first match
        if s.finish_reason == "stop":
            assert s.matched_stop in stops and text.endswith(s.matched_stop)
        else:
            assert len(s.response_ids) == 40 and not any(stop in text for stop in stops)


def test_inverse_cdf_sampling_matches_distribution():
    torch.manual_seed(0)
    logits = torch.randn(1, 6) * 1.5
    n = 20000
    state = make_state([0.8] * n, [1.0] * n, [-1] * n, list(range(n)), torch.device("cpu"))
    sampled = sample_tokens(logits.expand(n, 6), state)
    tokens, logprobs = sampled.tokens, sampled.logprobs
    expected = torch.softmax(logits[0] / 0.8, -1)
    freq = torch.bincount(tokens, minlength=6).float() / n
    assert float((freq - expected).abs().max()) < 0.015  # ~4 sigma at n=20000
    torch.testing.assert_close(logprobs, torch.log(expected)[tokens], atol=1e-6, rtol=0)
    # top-k 2 keeps exactly the two most likely tokens, in proportion
    state = make_state([0.8] * n, [1.0] * n, [2] * n, list(range(n)), torch.device("cpu"))
    tokens = sample_tokens(logits.expand(n, 6), state).tokens
    top2 = expected.topk(2).indices
    assert set(tokens.unique().tolist()) == set(top2.tolist())
    share = float((tokens == top2[0]).float().mean())
    assert abs(share - float(expected[top2[0]] / expected[top2].sum())) < 0.015


def test_update_weights_gives_donor_outputs(model):
    donor = tiny_model(seed=1, scale=3.0)
    engine = LocalEngine(tiny_model(seed=0, scale=3.0), char_tokenizer())
    reference = LocalEngine(donor, char_tokenizer())
    params = SamplingParams(n=2, max_new_tokens=10, seed=9)
    before = engine.generate(requests_for(params))
    engine.update_weights(((k, v.clone()) for k, v in donor.state_dict().items()), version=3)
    after, expected = engine.generate(requests_for(params)), reference.generate(requests_for(params))
    assert [s.response_ids for s in after] == [s.response_ids for s in expected]
    assert [s.response_ids for s in after] != [s.response_ids for s in before]
    for got, want in zip(after, expected):
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-6, rtol=0)
    assert {s.weight_version for s in after} == {3} and engine.weight_version == 3
    for name, tensor in donor.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], tensor)


def test_update_weights_is_strict(model):
    engine = LocalEngine(tiny_model(seed=0), char_tokenizer())
    state = dict(tiny_model(seed=1).state_dict())
    with pytest.raises(WeightUpdateError, match="unknown parameter name 'model.layers.9.mlp.up_proj.weight'"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))], 1)
    with pytest.raises(WeightUpdateError, match=r"'model.norm.weight' has shape \(3,\).*expects \(64,\)"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))], 1)
    state.pop("model.norm.weight")
    with pytest.raises(WeightUpdateError, match="left 1 of .* stale.*model.norm.weight"):
        engine.update_weights(state.items(), 1)
    assert engine.weight_version == 0


def test_tied_embeddings_update_through_either_name():
    engine = LocalEngine(tiny_model(seed=0, tie_word_embeddings=True), char_tokenizer())
    donor = tiny_model(seed=1, tie_word_embeddings=True)
    hf_checkpoint = {k: v for k, v in donor.state_dict().items() if k != "lm_head.weight"}  # as HF saves it
    engine.update_weights(hf_checkpoint.items(), version=1)
    assert torch.equal(engine.model.lm_head.weight, donor.model.embed_tokens.weight)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    assert ([s.response_ids for s in engine.generate(requests_for(params))]
            == [s.response_ids for s in LocalEngine(donor).generate(requests_for(params))])


def test_abort_ends_running_generation(model):
    engine = LocalEngine(model, char_tokenizer(), eos_token_ids=[])
    timer = threading.Timer(0.3, engine.abort)
    timer.start()
    out = engine.generate(requests_for(SamplingParams(n=2, max_new_tokens=100_000, seed=0)))
    timer.join()
    assert {s.finish_reason for s in out} == {"abort"}
    assert all(0 < len(s.response_ids) < 100_000 for s in out)


# ----- KV kept for a continued sequence (an episode's next turn) ---------------------------------
# fp32 log-probs vs the float64 forward: a few hundred ulp covers the summation-order differences of
# a padded, cached batch vs one unpadded pass
FP32_LOGPROB_TOL = 256 * torch.finfo(torch.float32).eps


def prefill_widths(model):
    """Records the width of every forward's input_ids; the first of each generate call is its prefill."""
    widths: list[int] = []
    handle = model.register_forward_pre_hook(lambda _m, _a, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                             with_kwargs=True)
    return widths, handle


def first_turn(engine, stop_ids=tuple(range(100, 160))):
    # seeded sampling with a fifth of the vocabulary as stop ids: rows stop at steps 1 to 8, two of
    # them before a quarter of the batch has (they stay in it, fed further, until it compacts)
    params = SamplingParams(n=4, max_new_tokens=8, seed=3, stop_token_ids=stop_ids)
    return engine.generate([GenerationRequest(p, params, f"g{i}", keep_kv=True) for i, p in enumerate(PROMPTS)])


def next_turns(samples):
    """The second turn of each stopped sample: its ids + an observation of 1-4 ids."""
    params = SamplingParams(max_new_tokens=6, seed=8, ignore_eos=True)
    return [GenerationRequest(tuple(s.prompt_ids + s.response_ids) + tuple(range(60, 61 + k % 4)), params, f"t{k}")
            for k, s in enumerate(samples) if s.finish_reason == "stop"]


def assert_same_as_a_full_prefill(model, requests, samples):
    """`samples` are what a fresh engine (nothing kept) samples for `requests`, and their log-probs
    match a float64 forward."""
    full = LocalEngine(model, char_tokenizer()).generate(requests)
    assert [s.response_ids for s in samples] == [s.response_ids for s in full]
    for s in samples:
        torch.testing.assert_close(torch.tensor(s.logprobs, dtype=torch.float64),
                                   float64_logprobs(model, s.prompt_ids, s.response_ids),
                                   atol=FP32_LOGPROB_TOL, rtol=0)


def test_a_continued_sequence_prefills_only_its_new_ids_and_samples_as_a_full_prefill(model):
    engine = LocalEngine(model, char_tokenizer())
    first = first_turn(engine)
    turns = next_turns(first)
    assert len(turns) >= 3 and len(engine._kept) == len(first)  # stopped and length-cut rows
    widths, handle = prefill_widths(model)
    try:
        continued = engine.generate(turns)
    finally:
        handle.remove()
    assert widths[0] == max(len(t.prompt_ids) - len(s.prompt_ids) - len(s.response_ids) + 1
                            for t, s in zip(turns, [s for s in first if s.finish_reason == "stop"]))
    assert len(engine._kept) == len(first) - len(turns)  # used entries are dropped; these asked for none
    assert_same_as_a_full_prefill(model, turns, continued)


def test_continued_and_new_prompts_share_one_batch(model):
    engine = LocalEngine(model, char_tokenizer())
    turns = next_turns(first_turn(engine))[:2] + [GenerationRequest((3, 4, 5, 6), SamplingParams(max_new_tokens=6,
                                                                                                seed=2), "new")]
    assert_same_as_a_full_prefill(model, turns, engine.generate(turns))


def test_new_weights_drop_the_kept_kv(model):
    donor = tiny_model(seed=1, scale=3.0)
    engine = LocalEngine(tiny_model(seed=0, scale=3.0), char_tokenizer())
    turns = next_turns(first_turn(engine))
    engine.update_weights(((k, v.clone()) for k, v in donor.state_dict().items()), version=1)
    assert len(engine._kept) == 0
    widths, handle = prefill_widths(engine.model)
    try:
        after = engine.generate(turns)
    finally:
        handle.remove()
    assert widths[0] == max(len(t.prompt_ids) for t in turns)  # everything prefilled again
    expected = LocalEngine(donor, char_tokenizer()).generate(turns)
    assert [s.response_ids for s in after] == [s.response_ids for s in expected]


def test_kept_prefixes_longest_strict_prefix_and_byte_budget():
    from megatron_grpo.rollout.kept_kv import KeptPrefix, KeptPrefixes

    def prefix(ids):  # one layer, 2 heads, 4 dims: 32 bytes per id per tensor
        return KeptPrefix(tuple(ids), ((torch.zeros(2, len(ids), 4), torch.zeros(2, len(ids), 4)),))

    kept = KeptPrefixes(max_bytes=64 * 7)
    kept.keep(prefix([1, 2]))
    kept.keep(prefix([1, 2, 3, 4]))
    assert kept.longest_prefix_of([1, 2, 3, 4, 5]).ids == (1, 2, 3, 4)
    assert kept.longest_prefix_of([1, 2, 3, 4]).ids == (1, 2)  # an equal sequence leaves nothing to prefill
    assert kept.longest_prefix_of([1, 3, 4]) is None
    kept.keep(prefix([7, 8]))  # 2 + 4 + 2 ids > 7: the oldest goes
    assert kept.longest_prefix_of([1, 2, 9]) is None and kept.longest_prefix_of([7, 8, 9]).ids == (7, 8)
    kept.discard((7, 8))
    assert len(kept) == 1 and kept.longest_prefix_of([7, 8, 9]) is None
