"""LoRA (megatron_grpo/lora/): the Megatron policy with adapters against transformers + peft 0.21 (the
reference LoRA), at TP1, TP2 with sequence parallelism and PP2; the base with adapters off; the merged
export; PEFT folders in and out; training only the adapters."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from megatron_grpo.models.tiny import save_tiny_hf_model
from megatron_grpo.testing.distributed import run_distributed
from megatron_grpo.testing.floats import assert_close_to_float64, tolerance

PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 4, 8.0


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def peft_reference(tmp_path_factory):
    """A tiny Qwen3, a PEFT adapter on it with random non-zero A and B (k_proj left out, so a fused layer
    carries adapters on some of its projections only), and the float64 logits of both with transformers."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora")
    base_dir = save_tiny_hf_model("qwen3", root / "base", seed=0)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float64)
    targets = [t for t in PEFT_TARGETS if t != "k_proj"]
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64) * 0.2)
    model.save_pretrained(str(root / "adapter"))
    tokens = _tokens(model.config.vocab_size)
    with torch.no_grad():
        with_adapter = model(tokens).logits
        with model.disable_adapter():
            base = model(tokens).logits
    assert (with_adapter - base).abs().max() > 0.05 * base.abs().max()  # the adapter changes the logits
    return dict(base_dir=str(base_dir), adapter_dir=str(root / "adapter"), with_adapter=with_adapter, base=base)


def _megatron_logits(rank, world_size, base_dir, adapter_dir, tp, pp, sp):
    from megatron_grpo.convert import export_hf_weights, load_hf_weights
    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel
    from megatron_grpo.lora.adapters import adapters_off
    from megatron_grpo.lora.attach import LoraSettings, attach_adapters
    from megatron_grpo.lora.peft_folder import load_adapter_folder, read_adapter_config
    from megatron_grpo.models import build_model
    from megatron_grpo.models.hf_config import ModelArchitecture
    from megatron_grpo.testing.logits import forward_only_logits

    layout = ParallelLayout(tensor=tp, pipeline=pp, sequence_parallel=sp)
    initialize_model_parallel(layout)
    cfg = ModelArchitecture.from_hf(base_dir, tensor_parallel=tp, vocab_multiple=8)
    chunks = build_model(cfg, layout)
    load_hf_weights(chunks, cfg, base_dir)
    peft = read_adapter_config(adapter_dir)
    attach_adapters(chunks, cfg, LoraSettings(peft.rank, peft.alpha, peft.dropout, peft.target_modules))
    load_adapter_folder(chunks, adapter_dir)
    tokens = _tokens(cfg.vocab_size)
    logits = forward_only_logits(chunks, tokens)
    with adapters_off(chunks):
        base = forward_only_logits(chunks, tokens)
    merged = dict(export_hf_weights(chunks, cfg))  # what the engines get with lora.sync=merged
    trainable = sorted(n for c in chunks for n, p in c.named_parameters() if p.requires_grad)
    out = dict(trainable=trainable, merged=merged)
    if logits is not None:
        out.update(logits=logits[..., :cfg.vocab_size], base=base[..., :cfg.vocab_size])
    return out


@pytest.fixture(scope="module")
def merged_reference(peft_reference):
    """transformers' logits of the HF model peft's merge_and_unload() makes, float64."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(peft_reference["base_dir"], dtype=torch.float64)
    return PeftModel.from_pretrained(model, peft_reference["adapter_dir"]).merge_and_unload().state_dict()


@pytest.mark.parametrize("tp, pp, sp", [(1, 1, False), (2, 1, True), (1, 2, False)])
def test_logits_equal_transformers_with_peft(peft_reference, merged_reference, tp, pp, sp):
    results = run_distributed(_megatron_logits, world_size=tp * pp, timeout=300,
                              args=(peft_reference["base_dir"], peft_reference["adapter_dir"], tp, pp, sp))
    for result in results[-tp:]:  # the last pipeline stage's ranks
        assert_close_to_float64(result["logits"], peft_reference["with_adapter"], dtype=torch.float32, terms=256,
                                name=f"logits with the adapter, TP{tp} PP{pp} SP={sp}")
        assert_close_to_float64(result["base"], peft_reference["base"], dtype=torch.float32, terms=256,
                                name=f"logits with adapters off, TP{tp} PP{pp}")
    for result in results:
        assert result["trainable"] and all("_lora.lora_" in name for name in result["trainable"])
        for name, tensor in result["merged"].items():  # every stage's share of the merged HF tensors
            assert_close_to_float64(tensor, merged_reference[name], dtype=torch.float32, terms=RANK,
                                    name=f"merged {name}")
    exported = {name for r in results for name in r["merged"]}
    assert exported == {n for n in merged_reference if n != "lm_head.weight"}


# ----- a LoRA run: training, checkpoint, resume, export -----------------------------------------------
LORA_RUN = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4", "logging.console=false",
            "logging.plot=false", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1", "checkpoint.save_interval=2",
            "eval.interval=0"]


def _train_lora(rank, world_size, overrides):
    from megatron_grpo.config import load_config
    from megatron_grpo.trainer.loop import train

    train(load_config("recipes/tiny_cpu_lora.yaml", overrides))


def _logits_of(model_dir: Path, adapter_dir: Path | None, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    with torch.no_grad():
        return model(tokens).logits


def test_a_lora_run_trains_the_adapters_against_its_base_resumes_bitwise_and_exports_peft(tmp_path):
    """tiny_cpu_lora with the KL loss, 3 steps straight and 2 + resumed 1: only adapters train (the base in the
    checkpoint is the initial model's), the KL reference is the base (0 at step 1, > 0 later), the engine holds
    the merged weights (no trainer-engine mismatch), the resumed run equals the straight one bitwise, and
    `export` writes a PEFT folder that peft loads onto the HF base with logits equal to the merged export's."""
    from megatron_grpo.cli import main as cli
    from tests.test_checkpoint import _metrics

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_distributed(_train_lora, 1, ([*LORA_RUN, "trainer.total_steps=3", f"logging.output_dir={straight}"],),
                    timeout=300)
    run_distributed(_train_lora, 1, ([*LORA_RUN, "trainer.total_steps=2", f"logging.output_dir={resumed}"],),
                    timeout=300)
    run_distributed(_train_lora, 1, ([*LORA_RUN, "trainer.total_steps=3", f"logging.output_dir={resumed}"],),
                    timeout=300)
    records, again = _metrics(straight), _metrics(resumed)
    assert sorted(records) == sorted(again) == [1, 2, 3]
    assert records[3] == again[3], "the resumed LoRA run differs from the straight one"
    assert records[1]["invariant/kl_at_step1"] == 0.0 and records[3]["actor/kl"] > 0
    # the engine's merged weights give the trainer's log-probs up to float32 rounding (~2e-6 here, as without LoRA)
    assert all(r["mismatch/abs_logp_diff_max"] <= tolerance(torch.float32, terms=4096) for r in records.values())

    peft_dir, merged_dir = tmp_path / "peft", tmp_path / "merged"
    assert cli(["export", str(straight), "--out", str(peft_dir)]) == 0
    assert cli(["export", str(straight), "--merged", "--out", str(merged_dir)]) == 0
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], len(config["target_modules"])) == (16, 32, 7)
    base_dir = straight / "initial_model"
    tokens = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(1))
    with_adapter, merged, base = (_logits_of(base_dir, peft_dir, tokens), _logits_of(merged_dir, None, tokens),
                                  _logits_of(base_dir, None, tokens))
    # PEFT puts the adapters on the initial model's weights, --merged folds them into the checkpoint's: equal
    # logits also show the base did not move in training
    assert_close_to_float64(merged.float(), with_adapter, dtype=torch.float32, terms=64, name="merged vs PEFT")
    assert (with_adapter - base).abs().max() > 1e-3  # three updates moved the adapters off B = 0


@pytest.mark.slow
def test_a_lora_run_saved_at_tp2_with_sequence_parallelism_resumes_at_tp1(tmp_path):
    """tiny_cpu with rank-8 adapters, 2 ranks at TP2 + SP (distributed optimizer), saving at step 2; resumed
    by one process: the adapters and their optimizer state load bitwise in the new layout (resaved, key by
    key), the engine gets the same merged weights, and step 3 equals the TP2 run's within the layout's
    rounding (tests/test_resume_layouts.py's tolerances)."""
    from tests.test_resume_layouts import FAST, _assert_same_state, _compare_step
    from tests.train_harness import train_capturing

    lora = [*FAST, "model.lora.rank=8", "model.lora.alpha=16", "trainer.total_steps=3"]
    origin = tmp_path / "origin"
    at_tp2 = run_distributed(train_capturing, 2, ([*lora, "parallel.tensor=2", "parallel.sequence_parallel=true",
                                                   "checkpoint.save_interval=2", f"logging.output_dir={origin}"],),
                             timeout=300)[0]
    step_2 = origin / "checkpoints" / "step_2"
    at_tp1 = run_distributed(train_capturing, 1, ([*lora, f"checkpoint.resume={step_2}",
                                                   f"logging.output_dir={tmp_path / 'tp1'}"],
                                                  None, tmp_path / "resaved"), timeout=300)[0]
    _assert_same_state(step_2 / "model_optim", tmp_path / "resaved")
    for name, value in at_tp2["steps"][2].items():
        assert torch.equal(at_tp1["at_resume"][name], value), name
    _compare_step(at_tp1, at_tp2, 3, "LoRA TP2+SP -> TP1")


# ----- configuration: the recipe's words, refusals, verl's keys ------------------------------------------
def test_the_recipe_vocabulary_is_the_target_table():
    from megatron_grpo.config.names import LORA_ALL_LINEAR, LORA_TARGET_MODULES
    from megatron_grpo.lora.targets import ALL_LINEAR, TARGET_MODULES

    assert (LORA_TARGET_MODULES, LORA_ALL_LINEAR) == (TARGET_MODULES, ALL_LINEAR)


@pytest.mark.parametrize("overrides, message", [
    (["model.lora.rank=-1"], r"model.lora.rank=-1: expected 0 \(no LoRA\) or a positive integer"),
    (["model.lora.alpha=0"], "model.lora.alpha=0.0: expected a positive number"),
    (["model.lora.dropout=1.0"], r"model.lora.dropout=1.0: expected a probability in \[0, 1\)"),
    (["model.lora.target_modules=[q_proj,lm_head]"], r"\['lm_head'\] are not linear layers of the model"),
    (["model.lora.target_modules=[]"], "model.lora.target_modules is empty"),
    (["ref.model_path=/some/model"], "ref.model_path with model.lora"),
    (["ref.param_offload=true"], "ref.param_offload with model.lora"),
    (["model.attention_backend=te", "trainer.device=cuda"], "model.lora with model.attention_backend=te"),
])
def test_bad_lora_settings_are_refused_in_one_line(overrides, message):
    from megatron_grpo.config import load_config, validate
    from megatron_grpo.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        validate(load_config("tiny_cpu_lora", overrides))


def test_lora_on_a_moe_model_is_refused():
    from megatron_grpo.config import load_config, validate
    from megatron_grpo.errors import ConfigError

    with pytest.raises(ConfigError, match="model.lora with model_type qwen3_moe: adapters on MoE experts"):
        validate(load_config("tiny_cpu_moe", ["model.lora.rank=8"]))


def test_an_adapter_folder_that_does_not_fit_is_refused(peft_reference, tmp_path):
    """model.lora.adapter_path: its rank / targets against the recipe's (before any model is built), its
    tensors' shapes against the base (when they are loaded), and PEFT settings we cannot reproduce."""
    from megatron_grpo.config import load_config
    from megatron_grpo.errors import ConfigError
    from megatron_grpo.lora.peft_folder import read_adapter_config
    from megatron_grpo.trainer.assembly.lora import check_adapter_folder

    adapter = peft_reference["adapter_dir"]
    targets = "[q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"  # the fixture leaves k_proj out
    check_adapter_folder(load_config("tiny_cpu_lora", [f"model.lora.adapter_path={adapter}", "model.lora.rank=4",
                                                       "model.lora.alpha=8", f"model.lora.target_modules={targets}"]))
    with pytest.raises(ConfigError, match=r"adapter_config.json\): r=4 but the recipe's model.lora says 16"):
        check_adapter_folder(load_config("tiny_cpu_lora", [f"model.lora.adapter_path={adapter}"]))
    with pytest.raises(ConfigError, match="target_modules="):
        check_adapter_folder(load_config("tiny_cpu_lora", [f"model.lora.adapter_path={adapter}", "model.lora.rank=4",
                                                           "model.lora.alpha=8"]))
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps(dict(config, use_dora=True)))
    with pytest.raises(ConfigError, match="use_dora=True is not supported"):
        read_adapter_config(dora)
    results = run_distributed(_load_into_another_shape, 1, (peft_reference["base_dir"], adapter), timeout=120)
    assert re.search(r"self_attn.q_proj.lora_A.weight has shape \[4, (\d+)\]; the base model and rank 8 expect "
                     r"\[8, \1\]", results[0]), results[0]


def _load_into_another_shape(rank, world_size, base_dir, adapter_dir):
    """The folder's rank-4 tensors loaded into rank-8 adapters: one CheckpointError naming tensor and shapes."""
    from megatron_grpo.convert import load_hf_weights
    from megatron_grpo.errors import CheckpointError
    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel
    from megatron_grpo.lora.attach import LoraSettings, attach_adapters
    from megatron_grpo.lora.peft_folder import load_adapter_folder
    from megatron_grpo.models import build_model
    from megatron_grpo.models.hf_config import ModelArchitecture

    initialize_model_parallel(ParallelLayout())
    cfg = ModelArchitecture.from_hf(base_dir, vocab_multiple=8)
    chunks = build_model(cfg, ParallelLayout())
    load_hf_weights(chunks, cfg, base_dir)
    attach_adapters(chunks, cfg, LoraSettings(8, 16.0, 0.0, ("q_proj",)))
    try:
        load_adapter_folder(chunks, adapter_dir)
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def test_verls_lora_keys_translate():
    from megatron_grpo.config.from_verl import parse_command_line, translate

    model = "actor_rollout_ref.model"
    peft_style = translate(parse_command_line([f"{model}.lora_rank=32", f"{model}.lora_alpha=64",
                                               f"{model}.target_modules=all-linear"])).values
    peft_style.pop("reward.function")  # verl's default reward manager, translated with any command line
    assert peft_style == {"model.lora.rank": 32, "model.lora.alpha": 64, "model.lora.target_modules": ["all-linear"]}
    megatron_style = translate(parse_command_line([f"{model}.lora.rank=8",
                                                   f"{model}.lora.target_modules=[linear_qkv,linear_fc2]"])).values
    megatron_style.pop("reward.function")
    assert megatron_style == {"model.lora.rank": 8,
                              "model.lora.target_modules": ["q_proj", "k_proj", "v_proj", "down_proj"]}
