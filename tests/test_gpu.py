"""The CUDA path on one GPU: `pytest -m gpu tests/test_gpu.py` (bash scripts/gpu_check.sh runs it).

Skipped without CUDA, except under `bash scripts/gpu_check.sh --dry-run`
(MEGATRON_GRPO_GPU_CHECK_DRY_RUN=1), which runs the same code on CPU with tiny shapes so that a
session lent a GPU never spends it on a broken test. Measured figures go to the JUnit report
through pytest's record_property ("measured" / "target" strings, plus the numbers); the check's
gpu_check.json reads them from there.

1. Ops on the device: ops.vocab_parallel (log-probs + entropy) and ops.fused_head against dense
   torch in float64 on the same inputs, fp32 and bf16, with the references and dtype-derived bounds
   of tests/test_vocab_parallel.py / tests/test_fused_head.py. On CUDA at T = 4096 tokens and the
   Qwen3 vocabulary (151,936, plus 128 padded columns), so the default CUDA chunking runs several
   chunks; matmuls in true fp32 (TF32 off) for the fp32 cases.
2. bf16 GPTModel against fp32 on the same weights: the trainer's build (models.build_model, bf16 ->
   megatron's Float16Module) and its loss path (vocab-parallel log-probs + entropy). The fp32 model's
   weights are first rounded to bf16, and the bf16 model gets exactly those values, so the two differ
   only in the rounding of the computation. The fp32 run stands in for float64: its rounding
   (2^-24 per operation) is 2^16 times below bf16's. Bound (megatron_grpo.testing.floats):
   |bf16 - fp32| <= 4 sqrt(K) eps(bf16) max|fp32| per tensor, K the bf16 roundings that accumulate
   into a value: per layer of megatron's local spec 14 (input norm, QKV, q/k norms, RoPE, scores,
   softmax cast, context, projection, residual, MLP norm, fc1, SwiGLU, fc2, residual), plus the
   final norm and the output layer: K = 14 L + 2 for logits (log-probs and entropy are fp32 from
   them: K + 1); a gradient passes the chain forward and back plus its own matmul: 2 K + 1.
3. The local engine on the device (HF transformers, KV cache): its sampled-token log-probs against
   a cache-free forward of the same model (fp32: the two differ in summation order only), and the
   training-inference mismatch: the engine's log-probs against the trainer's recompute
   (trainer.step.train_step.compute_logprobs: megatron GPTModel + vocab-parallel log-probs on the
   trainer's collated micro-batch) over the generated tokens, mean and max |engine - trainer|, in
   fp32 and bf16 (engine and trainer in the same dtype). The published anchor is ~0.011-0.012 mean
   for vLLM / SGLang against an HF recompute at 4B in bf16. The model is random but its weights are
   scaled so that next-token distributions are peaked like a trained model's (entropy and logit
   range are recorded with the figures).
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from megatron_grpo.testing.distributed import run_distributed
from megatron_grpo.testing.floats import tolerance

pytestmark = pytest.mark.gpu

DRY_RUN = os.environ.get("MEGATRON_GRPO_GPU_CHECK_DRY_RUN") == "1"


def check_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    if DRY_RUN:
        return torch.device("cpu")
    pytest.skip("needs a CUDA device (bash scripts/gpu_check.sh --dry-run runs these on CPU with tiny shapes)")


def error_ratio(actual: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype, terms: int) -> float:
    """max|actual - reference| as a fraction of floats.tolerance(dtype, terms) * max|reference|
    (the bound of testing.floats.assert_close_to_float64; <= 1 passes)."""
    reference = reference.detach().double()
    error = float((actual.detach().double() - reference).abs().max())
    allowed = tolerance(dtype, terms) * float(reference.abs().max())
    return error / allowed if allowed else (0.0 if error == 0 else math.inf)


def record(record_property, measured: str, target: str = "", **numbers) -> None:
    record_property("measured", measured)
    if target:
        record_property("target", target)
    for name, value in numbers.items():
        record_property(name, json.dumps(value))


# ----- 1. ops on the device ----------------------------------------------------------------------
def op_shape(device: torch.device) -> tuple[int, int, int]:
    """(tokens, vocab, padded columns)."""
    return (4096, 151936, 151936 + 128) if device.type == "cuda" else (21, 300, 384)


@pytest.fixture
def true_fp32():
    """fp32 cases compare against float64 with fp32's rounding: no TF32 in their matmuls."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def logit_case(device, dtype, tokens, vocab, padded, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = (torch.randn(tokens, padded, generator=gen, device=device) * 2).to(dtype)
    logits[:, vocab:] = 50.0  # padded columns: large on purpose, they must carry no probability
    targets = torch.randint(0, vocab, (tokens,), generator=gen, device=device)
    targets[:2] = -100
    targets[-1] = vocab - 1
    mask = torch.zeros(tokens, dtype=torch.bool, device=device)
    mask[3] = True
    upstream = (torch.randn(tokens, generator=gen, device=device), torch.randn(tokens, generator=gen, device=device))
    return logits, targets, mask, upstream


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_vocab_parallel_logprobs_entropy_on_device(dtype, true_fp32, record_property):
    from tests.test_vocab_parallel import BF16_GRAD_TERMS, dense_reference, ours

    device = check_device()
    tokens, vocab, padded = op_shape(device)
    logits, targets, mask, upstream = logit_case(device, dtype, tokens, vocab, padded)
    ref_lp, ref_h, ref_g_both, ref_g_lp = dense_reference(logits, targets, mask, upstream, vocab, 0.8)
    lp, h, g_both, lp_only, g_lp = ours(logits, targets, mask, upstream, vocab, 0.8, None)
    assert lp.device.type == device.type and lp.dtype == torch.float32 and g_both.dtype == dtype
    grad_dtype, grad_terms = (dtype, BF16_GRAD_TERMS) if dtype == torch.bfloat16 else (torch.float32, vocab)
    ratios = {"logp": error_ratio(lp, ref_lp, torch.float32, vocab),
              "entropy": error_ratio(h, ref_h, torch.float32, vocab),
              "logp_only": error_ratio(lp_only, ref_lp, torch.float32, vocab),
              "grad_logp_entropy": error_ratio(g_both, ref_g_both, grad_dtype, grad_terms),
              "grad_logp": error_ratio(g_lp, ref_g_lp, grad_dtype, grad_terms)}
    worst = max(ratios, key=ratios.get)
    record(record_property, f"[{tokens} x {vocab}] {dtype}: worst {worst} at {ratios[worst]:.3f} of its bound",
           "<= 1 (4 sqrt(terms) eps)", error_ratios=ratios)
    assert all(r <= 1.0 for r in ratios.values()), ratios


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_head_on_device(dtype, true_fp32, record_property):
    from tests.test_fused_head import TERMS

    device = check_device()
    tokens, vocab, padded = op_shape(device)
    hidden_size = 1024 if device.type == "cuda" else 24
    gen = torch.Generator(device=device).manual_seed(1)
    hidden = torch.randn(tokens, hidden_size, generator=gen, device=device).to(dtype)
    weight = (torch.randn(padded, hidden_size, generator=gen, device=device) / hidden_size ** 0.5 * 2).to(dtype)
    _, targets, mask, upstream = logit_case(device, dtype, tokens, vocab, padded, seed=2)
    from megatron_grpo.ops.fused_head import fused_head_logprobs_and_entropy

    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logsm = torch.log_softmax((h @ w.t())[:, :vocab] / 0.9, dim=-1)
    ignored = mask | (targets == -100)
    ref_lp = logsm.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(ignored, 0.0)
    ref_h = -(logsm.exp() * logsm).sum(-1).masked_fill(ignored, 0.0)
    g_lp, g_h = (u.double() for u in upstream)
    ref_gh, ref_gw = torch.autograd.grad((ref_lp * g_lp + ref_h * g_h).sum(), (h, w))
    del logsm, h, w
    x, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = fused_head_logprobs_and_entropy(x, wt, targets, temperature=0.9, vocab_size=vocab, ignore_mask=mask)
    gx, gw = torch.autograd.grad((lp * upstream[0] + ent * upstream[1]).sum(), (x, wt))
    assert gx.dtype == gw.dtype == dtype and lp.dtype == torch.float32
    terms = TERMS[dtype]
    ratios = {"logp": error_ratio(lp, ref_lp, dtype, terms), "entropy": error_ratio(ent, ref_h, dtype, terms),
              "grad_hidden": error_ratio(gx, ref_gh, dtype, terms),
              "grad_weight": error_ratio(gw, ref_gw, dtype, terms)}
    worst = max(ratios, key=ratios.get)
    record(record_property, f"[{tokens} x {hidden_size}] @ [{padded} x {hidden_size}]^T {dtype}: worst {worst} "
           f"at {ratios[worst]:.3f} of its bound", "<= 1 (4 sqrt(terms) eps)", error_ratios=ratios)
    assert all(r <= 1.0 for r in ratios.values()), ratios


# ----- 2. bf16 GPTModel vs fp32 ------------------------------------------------------------------
def qwen3_config(device_type: str) -> dict:
    shape = (dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, vocab_size=32768) if device_type == "cuda" else
             dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512))
    return dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], max_position_embeddings=4096,
                rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=False, hidden_act="silu",
                initializer_range=0.02, tie_word_embeddings=False, **shape)


def _bf16_vs_fp32(rank, world_size):
    from megatron_grpo.launch import ParallelLayout, init_distributed, initialize_model_parallel
    from megatron_grpo.models import ModelArchitecture, build_model
    from megatron_grpo.models.builder import unwrap
    from megatron_grpo.ops.vocab_parallel import vocab_parallel_logprobs_and_entropy

    device = init_distributed().device
    initialize_model_parallel(ParallelLayout(), seed=1234)
    mc = ModelArchitecture.from_hf(qwen3_config(device.type))
    (fp32,) = build_model(mc, dtype=torch.float32, backend="local")
    (bf16,) = build_model(mc, dtype=torch.bfloat16, backend="local")
    fp32.to(device)
    bf16.to(device)
    with torch.no_grad():
        for param in fp32.parameters():
            param.copy_(param.bfloat16().float())  # representable in bf16: the copy below is exact
    unwrap(bf16).load_state_dict(unwrap(fp32).state_dict(), strict=True)
    batch, seq = (2, 256) if device.type == "cuda" else (2, 16)
    gen = torch.Generator(device=device).manual_seed(3)
    tokens = torch.randint(0, mc.vocab_size, (batch, seq), generator=gen, device=device)
    positions = torch.arange(seq, device=device).expand(batch, seq).contiguous()
    targets = torch.roll(tokens, -1, dims=1)
    upstream = (torch.randn(batch, seq, generator=gen, device=device), torch.randn(batch, seq, generator=gen,
                                                                                   device=device))
    out = {}
    for name, model in (("fp32", fp32), ("bf16", bf16)):
        logits = model(tokens, positions, None)
        logp, entropy = vocab_parallel_logprobs_and_entropy(logits, targets, vocab_size=mc.vocab_size)
        ((logp * upstream[0]).sum() + (entropy * upstream[1]).sum()).backward()
        grads = {n: p.grad.detach().float().clone() for n, p in unwrap(model).named_parameters()}
        out[name] = dict(logits=logits.detach().float(), logp=logp.detach(), entropy=entropy.detach(), grads=grads)
    layers = mc.num_layers
    k = 14 * layers + 2
    ratios = {"logits": error_ratio(out["bf16"]["logits"], out["fp32"]["logits"], torch.bfloat16, k),
              "logp": error_ratio(out["bf16"]["logp"], out["fp32"]["logp"], torch.bfloat16, k + 1),
              "entropy": error_ratio(out["bf16"]["entropy"], out["fp32"]["entropy"], torch.bfloat16, k + 1)}
    grad_ratios = {n: error_ratio(out["bf16"]["grads"][n], g, torch.bfloat16, 2 * k + 1)
                   for n, g in out["fp32"]["grads"].items()}
    assert out["bf16"]["logits"].dtype == torch.float32  # Float16Module hands fp32 logits to the loss
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    rel = float((out["bf16"]["logp"] - out["fp32"]["logp"]).abs().mean())
    return dict(ratios=ratios, grad_ratios=grad_ratios, terms=k, mean_abs_logp_diff=rel,
                shape=f"{layers} layers, hidden {mc.hidden_size}, vocab {mc.vocab_size}, [{batch} x {seq}] tokens")


def test_bf16_gpt_model_forward_backward_matches_fp32(record_property):
    check_device()
    result = run_distributed(_bf16_vs_fp32, 1, init_group=False, timeout=300)[0]
    ratios, grad_ratios = result["ratios"], result["grad_ratios"]
    worst_grad = max(grad_ratios, key=grad_ratios.get)
    record(record_property, f"{result['shape']}: logits {ratios['logits']:.3f}, log-probs {ratios['logp']:.3f}, "
           f"entropy {ratios['entropy']:.3f}, worst grad ({worst_grad}) {grad_ratios[worst_grad]:.3f} of the "
           f"bound; mean |dlogp| {result['mean_abs_logp_diff']:.2e}",
           f"<= 1 (4 sqrt(K) eps(bf16), K = {result['terms']} fwd)", error_ratios=ratios, grad_error_ratios=grad_ratios)
    assert all(r <= 1.0 for r in ratios.values()), ratios
    assert all(r <= 1.0 for r in grad_ratios.values()), {n: r for n, r in grad_ratios.items() if r > 1.0}


# ----- 3. local engine and the training-inference mismatch --------------------------------------
def engine_config(device_type: str) -> dict:
    shape = (dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=64, vocab_size=151936) if device_type == "cuda" else
             dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=300))
    return dict(max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                **shape)


# (layer weight multiplier, logit std): the random model's non-norm layer weights are multiplied by
# the first, and the (tied) embedding is scaled so that logits have the second as their standard
# deviation. On the CUDA shape that gives a mean next-token entropy of ~3.5 nats and logits up to
# ~27, like a trained model's, instead of a near-uniform distribution over 151,936 tokens.
WEIGHT_SCALE = {"cuda": (3.0, 5.0), "cpu": (3.0, 1.0)}
GENERATION = {"cuda": dict(prompts=16, n=4, prompt_length=64, new_tokens=128),
              "cpu": dict(prompts=3, n=2, prompt_length=6, new_tokens=8)}


def save_engine_model(folder, device_type: str) -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(**engine_config(device_type))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    layer_scale, logit_std = WEIGHT_SCALE[device_type]
    # final-norm outputs have unit RMS, so logit std = sqrt(hidden) * embedding std
    embedding_scale = logit_std / (config.hidden_size ** 0.5 * config.initializer_range)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.mul_(embedding_scale if "embed_tokens" in name else layer_scale)
    model.save_pretrained(folder)


def _engine_vs_trainer(rank, world_size, folder):
    from transformers import AutoModelForCausalLM

    from megatron_grpo.convert.loader import load_hf_weights
    from megatron_grpo.launch import ParallelLayout, init_distributed, initialize_model_parallel
    from megatron_grpo.models import ModelArchitecture, build_model
    from megatron_grpo.rollout.local import LocalEngine
    from megatron_grpo.rollout.types import GenerationRequest, SamplingParams
    from megatron_grpo.trainer.batches.batching import TrainSample, collate
    from megatron_grpo.trainer.step.train_step import compute_logprobs

    device = init_distributed().device
    initialize_model_parallel(ParallelLayout(), seed=1234)
    torch.backends.cuda.matmul.allow_tf32 = False
    mc = ModelArchitecture.from_hf(folder)
    g = GENERATION[device.type]
    gen = torch.Generator().manual_seed(5)
    # prompts of 4 lengths: the engine left-pads them (mask + positions), the trainer right-pads
    lengths = [g["prompt_length"] - (i % 4) * max(1, g["prompt_length"] // 8) for i in range(g["prompts"])]
    requests = [GenerationRequest(torch.randint(mc.vocab_size, (lengths[i],), generator=gen).tolist(),
                                  SamplingParams(n=g["n"], temperature=1.0, max_new_tokens=g["new_tokens"], seed=i),
                                  group_id=str(i)) for i in range(g["prompts"])]
    figures = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = "fp32" if dtype == torch.float32 else "bf16"
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        engine = LocalEngine(hf, None, device=device, eos_token_ids=[])
        samples = engine.generate(requests)
        # The engine against a cache-free forward of the same model on the unpadded sequence.
        cache_free, logit_max, entropies, logit_stds = [], 0.0, [], []
        with torch.no_grad():
            for s in samples[:: g["n"]]:
                ids = torch.tensor([s.prompt_ids + s.response_ids], device=device)
                logits = engine.model(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1].float()
                logsm = torch.log_softmax(logits, -1)
                ref = logsm.gather(1, torch.tensor(s.response_ids, device=device)[:, None]).squeeze(1)
                cache_free.append((torch.tensor(s.logprobs, device=device) - ref).abs())
                logit_max = max(logit_max, float(logits.abs().max()))
                entropies.append(-(logsm.exp() * logsm).sum(-1))
                logit_stds.append(logits.std(-1))
        engine.close()
        del engine, hf
        # The trainer's recompute of the same samples: megatron model, collated micro-batch.
        (chunk,) = build_model(mc, dtype=dtype, backend="local")
        load_hf_weights([chunk], mc, folder)
        chunk.to(device).eval()
        batch = [TrainSample(s.prompt_ids, s.response_ids, 0.0, rollout_logprobs=s.logprobs) for s in samples]
        micro = collate(batch, list(range(len(batch))))
        (trainer,) = compute_logprobs([chunk], [micro], temperature=1.0, vocab_size=mc.vocab_size, device=device)
        diff = (trainer - micro.per_token["rollout_logprobs"]).abs()[micro.loss_mask]
        del chunk
        cache_free = torch.cat(cache_free)
        figures[name] = dict(mismatch_mean=float(diff.mean()), mismatch_max=float(diff.max()), tokens=int(diff.numel()),
                             cache_free_mean=float(cache_free.mean()), cache_free_max=float(cache_free.max()),
                             logit_max=logit_max, entropy_mean=float(torch.cat(entropies).mean()),
                             logit_std=float(torch.cat(logit_stds).mean()),
                             logp_mean=float(micro.per_token["rollout_logprobs"][micro.loss_mask].mean()))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(figures=figures, layers=mc.num_layers, hidden=mc.hidden_size, vocab=mc.vocab_size)


@pytest.fixture(scope="module")
def engine_figures(tmp_path_factory):
    device = check_device()
    folder = tmp_path_factory.mktemp("engine_model")
    save_engine_model(folder, device.type)
    return run_distributed(_engine_vs_trainer, 1, args=(str(folder),), init_group=False, timeout=400)[0]


def fp32_logprob_bound(result: dict, name: str) -> float:
    """Two fp32 computations of log-probs from logits that went through L layers: each side within
    4 sqrt(K) eps(fp32) max|logit| per logit (K = 14 L + 2 roundings, the count of section 2's
    docstring, and the hidden size for the longest dot product), a log-prob twice that."""
    k = 14 * result["layers"] + 2 + result["hidden"]
    return 2 * 2 * tolerance(torch.float32, k) * result["figures"][name]["logit_max"]


def test_local_engine_on_device_matches_cache_free_forward(engine_figures, record_property):
    fp32, bf16 = engine_figures["figures"]["fp32"], engine_figures["figures"]["bf16"]
    bound = fp32_logprob_bound(engine_figures, "fp32")
    record(record_property, f"fp32 max |KV-cache - cache-free| {fp32['cache_free_max']:.2e} (bound {bound:.2e}); "
           f"bf16 mean / max {bf16['cache_free_mean']:.2e} / {bf16['cache_free_max']:.2e}",
           "fp32 within the bound", fp32=fp32, bf16=bf16)
    assert fp32["cache_free_max"] <= bound
    assert math.isfinite(bf16["cache_free_max"])


def test_training_inference_logprob_mismatch(engine_figures, record_property):
    """fp32: engine and trainer are the same function up to rounding, so they agree within fp32's
    bound (a wrong weight, position or mask exceeds it by orders of magnitude). bf16: the figure
    the issue asks for. Its bound is on the mean: each side's logits carry K = 14 L + 2 bf16
    roundings, independent ones adding up to an RMS error of about sqrt(K) eps / sqrt(12) times
    the logits' spread (their std over the vocabulary), a log-prob (z_t - lse) and the difference
    of two sides about 2x that; the bound is 4 sqrt(K) eps(bf16) logit std, a margin of ~7 on that
    estimate. The engine attending to its left padding, for one, exceeds it."""
    r = engine_figures
    fp32, bf16 = r["figures"]["fp32"], r["figures"]["bf16"]
    fp32_bound = fp32_logprob_bound(r, "fp32")
    bf16_bound = tolerance(torch.bfloat16, 14 * r["layers"] + 2) * bf16["logit_std"]
    record(record_property,
           f"bf16 mean {bf16['mismatch_mean']:.4f} / max {bf16['mismatch_max']:.3f} over {bf16['tokens']} generated "
           f"tokens (fp32: {fp32['mismatch_mean']:.1e} / {fp32['mismatch_max']:.1e}); {r['layers']} layers, hidden "
           f"{r['hidden']}, vocab {r['vocab']}, entropy {bf16['entropy_mean']:.2f} nats, logit std "
           f"{bf16['logit_std']:.1f}, max |logit| {bf16['logit_max']:.1f}; bf16 mean bound {bf16_bound:.3f}",
           "anchor ~0.011-0.012 mean (vLLM/SGLang vs HF, 4B, bf16)",
           fp32=fp32, bf16=bf16, fp32_bound=fp32_bound, bf16_mean_bound=bf16_bound)
    assert fp32["mismatch_max"] <= fp32_bound
    assert bf16["mismatch_mean"] <= bf16_bound and math.isfinite(bf16["mismatch_max"])
