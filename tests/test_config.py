"""Typed config: verl defaults, YAML recipes with defaults:, overrides, every error class, round trip."""
from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

import pytest
import yaml

from megatron_grpo.config import (
    Config,
    config_from_dict,
    load_config,
    resolve_recipe,
    to_dict,
    to_yaml,
    validate,
)
from megatron_grpo.errors import ConfigError

# A minimal valid base for validation tests: a model with known dims and synthetic data.
VALID = ["model.override_config={num_attention_heads: 8, num_key_value_heads: 4, num_hidden_layers: 4}",
         "data.task=reverse_digits", "rollout.n=4", "data.train_batch_size=16", "actor.ppo_mini_batch_size=8"]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def valid(*overrides: str) -> Config:
    return load_config(None, [*VALID, *overrides])


# ---------------------------------------------------------------- defaults


def test_defaults_equal_verl():
    c = Config()
    assert c.algorithm.adv_estimator == "grpo"
    assert c.algorithm.norm_adv_by_std_in_grpo is True
    assert c.algorithm.use_kl_in_reward is False
    assert c.algorithm.kl_penalty == "kl"
    assert c.algorithm.kl_ctrl.kl_coef == 0.001
    assert (c.algorithm.kl_ctrl.horizon, c.algorithm.kl_ctrl.target_kl) == (10000, 0.1)
    assert c.rollout.n == 1 and c.rollout.temperature == 1.0 and c.rollout.top_p == 1.0
    assert c.rollout.top_k == -1
    a = c.actor
    assert a.use_kl_loss is False and a.kl_loss_coef == 0.001 and a.kl_loss_type == "low_var_kl"
    assert a.loss_agg_mode == "token-mean"
    assert (a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c) == (0.2, 0.2, 3.0)
    assert a.entropy_coeff == 0.0 and a.ppo_epochs == 1 and a.ppo_mini_batch_size == 256
    assert a.policy_loss.loss_mode == "vanilla" and a.grad_clip == 1.0
    assert a.optim.lr == 1e-6 and a.optim.weight_decay == 0.01 and a.optim.lr_scheduler == "constant"
    assert c.data.train_batch_size == 1024
    assert (c.data.max_prompt_length, c.data.max_response_length) == (512, 512)
    assert c.data.truncation == "error" and c.data.prompt_key == "prompt"
    assert c.trainer.total_epochs == 30
    assert c.checkpoint.save_interval == -1 and c.eval.interval == -1
    assert c.algorithm.filter_groups.enable is False and c.algorithm.filter_groups.max_num_gen_batches == 0


def test_no_recipe_gives_defaults():
    assert load_config() == Config()


def test_shipped_recipes_load_and_validate():
    config = load_config("tiny_cpu")
    validate(config, world_size=1)
    assert config.rollout.engine == "local" and config.trainer.device == "cpu"
    assert config.actor.use_kl_loss is False  # tiny_cpu overrides base.yaml
    assert config.actor.kl_loss_type == "low_var_kl"
    base = load_config(resolve_recipe("base"))
    assert base.rollout.n == 5 and base.actor.use_kl_loss is True


# ---------------------------------------------------------------- YAML errors


def test_unknown_key_names_file_line_and_closest_sibling(tmp_path):
    path = write(tmp_path, "r.yaml", """
        actor:
          ppo_epochs: 2
          clip_ratio_hi: 0.28
        """)
    message = error_of(load_config, path)
    assert message == (f"unknown key 'actor.clip_ratio_hi' ({path}:3); did you mean 'actor.clip_ratio_high'?")


def test_unknown_key_suggests_same_name_in_other_section(tmp_path):
    path = write(tmp_path, "r.yaml", "actor:\n  lr: 0.1\n")
    assert "did you mean 'actor.optim.lr'?" in error_of(load_config, path)
    path = write(tmp_path, "s.yaml", "rolout:\n  n: 2\n")
    assert error_of(load_config, path) == f"unknown key 'rolout' ({path}:1); did you mean 'rollout'?"


def test_unknown_key_without_close_match_has_no_suggestion(tmp_path):
    path = write(tmp_path, "r.yaml", "trainer:\n  zzzzqqq: 1\n")
    assert error_of(load_config, path) == f"unknown key 'trainer.zzzzqqq' ({path}:2)"


@pytest.mark.parametrize("text, expected", [
    ("actor:\n  ppo_epochs: two\n", "actor.ppo_epochs: expected int, got 'two' (str) ({p}:2)"),
    ("actor:\n  ppo_epochs: 1.5\n", "actor.ppo_epochs: expected int, got 1.5 (float) ({p}:2)"),
    ("parallel:\n  sequence_parallel: 1\n",
     "parallel.sequence_parallel: expected bool, got 1 (int) ({p}:2)"),
    ("trainer:\n  seed: true\n", "trainer.seed: expected int, got True (bool) ({p}:2)"),
    ("data:\n  truncation: middle\n",
     "data.truncation: expected one of 'error', 'left', 'right', 'filter', got 'middle' (str) ({p}:2)"),
    ("data:\n  train_files: 3\n", "data.train_files: expected a list of str, got 3 (int) ({p}:2)"),
    ("rollout:\n  stop: </s>\n", "rollout.stop: expected a list of str, got '</s>' (str) ({p}:2)"),
    ("rollout:\n  stop_token_ids: [1, x]\n",
     "rollout.stop_token_ids[1]: expected int, got 'x' (str) ({p}:2)"),
    ("actor:\n  optim: 3\n", "actor.optim: expected a mapping (section), got 3 (int) ({p}:2)"),
    ("trainer:\n  total_epochs: null\n", "trainer.total_epochs: expected int, got null ({p}:2)"),
    ("model:\n  path: 7\n", "model.path: expected str or null, got 7 (int) ({p}:2)"),
])
def test_wrong_type_names_key_expected_type_and_value(tmp_path, text, expected):
    path = write(tmp_path, "r.yaml", text)
    assert error_of(load_config, path) == expected.format(p=path)


def test_floats_accept_ints_and_yaml11_exponents(tmp_path):
    # pyyaml reads `1e-6` (no dot) as a string; a float field still takes it
    path = write(tmp_path, "r.yaml", "actor:\n  optim:\n    lr: 1e-6\n  clip_ratio_c: 3\n")
    config = load_config(path)
    assert config.actor.optim.lr == 1e-6 and isinstance(config.actor.clip_ratio_c, float)
    assert error_of(load_config, write(tmp_path, "s.yaml", "actor:\n  optim:\n    lr: fast\n")).startswith(
        "actor.optim.lr: expected float, got 'fast' (str)")


def test_bad_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, "r.yaml", "actor:\n  ppo_epochs: 1\n   bad: indent\n")
    message = error_of(load_config, path)
    assert message.startswith(f"{path}:3: invalid YAML: ")
    path = write(tmp_path, "s.yaml", "data:\n  train_files: [a, b\nactor: {}\n")
    assert error_of(load_config, path).startswith(f"{path}:3: invalid YAML: ")


def test_duplicate_key_and_non_mapping_recipe(tmp_path):
    path = write(tmp_path, "r.yaml", "rollout:\n  n: 2\n  n: 4\n")
    assert error_of(load_config, path) == f"{path}:3: duplicate key 'rollout.n'"
    path = write(tmp_path, "s.yaml", "- a\n- b\n")
    assert error_of(load_config, path) == f"{path}:1: a recipe must be a mapping of sections, got list"


def test_empty_recipe_and_empty_section(tmp_path):
    assert load_config(write(tmp_path, "r.yaml", "")) == Config()
    assert load_config(write(tmp_path, "s.yaml", "rollout:\n  # n: 3\n")) == Config()


def test_missing_recipe_lists_available(tmp_path):
    message = error_of(load_config, "no_such_recipe")
    assert message.startswith("recipe 'no_such_recipe' not found") and "tiny_cpu" in message
    assert error_of(load_config, tmp_path / "x.yaml").startswith(f"recipe '{tmp_path / 'x.yaml'}' not found")


# ---------------------------------------------------------------- defaults: inheritance


def test_defaults_merge_in_order_then_recipe(tmp_path):
    write(tmp_path, "a.yaml", """
        rollout: {n: 2, stop: ["x", "y"], temperature: 0.7}
        actor: {optim: {lr: 0.1, weight_decay: 0.5}}
        """)
    (tmp_path / "sub").mkdir()
    write(tmp_path, "sub/b.yaml", "rollout: {n: 3}\nactor: {optim: {lr: 0.2}}\n")
    recipe = write(tmp_path, "r.yaml", """
        defaults: [a.yaml, sub/b.yaml]
        rollout:
          stop: ["z"]
        """)
    c = load_config(recipe)
    assert c.rollout.n == 3  # b after a
    assert c.rollout.temperature == 0.7  # only a sets it
    assert c.rollout.stop == ["z"]  # lists are replaced, not appended
    assert (c.actor.optim.lr, c.actor.optim.weight_decay) == (0.2, 0.5)  # mappings merge per key


def test_defaults_relative_to_including_file_and_errors_name_base_file(tmp_path):
    (tmp_path / "sub").mkdir()
    base = write(tmp_path, "sub/base.yaml", "defaults: [root.yaml]\nactor:\n  ppo_epoch: 2\n")
    write(tmp_path, "sub/root.yaml", "trainer: {seed: 7}\n")
    recipe = write(tmp_path, "r.yaml", "defaults: sub/base.yaml\n")
    assert error_of(load_config, recipe) == (
        f"unknown key 'actor.ppo_epoch' ({base}:3); did you mean 'actor.ppo_epochs'?")
    base.write_text("defaults: [root.yaml]\n")
    assert load_config(recipe).trainer.seed == 7


def test_defaults_errors(tmp_path):
    from megatron_grpo.config.recipe_file import RECIPE_DIR

    recipe = write(tmp_path, "r.yaml", "defaults: [missing.yaml]\n")
    looked = f"{tmp_path / 'missing.yaml'}, {RECIPE_DIR / 'missing.yaml'}"
    assert error_of(load_config, recipe) == (
        f"{recipe}:1: defaults entry 'missing.yaml' not found (looked for {looked})")
    write(tmp_path, "a.yaml", "defaults: [b.yaml]\n")
    write(tmp_path, "b.yaml", "defaults: [a.yaml]\n")
    assert error_of(load_config, tmp_path / "a.yaml").startswith("recipe defaults form a cycle: ")
    bad = write(tmp_path, "c.yaml", "defaults: {a: 1}\n")
    assert error_of(load_config, bad) == f"{bad}:1: defaults must be a list of recipe paths, got {{'a': 1}}"


# ---------------------------------------------------------------- overrides


def test_nested_and_typed_overrides(tmp_path):
    recipe = write(tmp_path, "r.yaml", "actor:\n  optim: {lr: 0.1, weight_decay: 0.3}\n")
    c = load_config(recipe, [
        "actor.optim.lr=1e-5", "rollout.n=8", "parallel.sequence_parallel=true",
        "trainer.total_steps=null", "actor.grad_clip=null", "data.truncation=left",
        "logging.experiment_name=1e3",  # a str field keeps the text
        "reward.kwargs.strict=false", "reward.kwargs.name=x",  # free-form mapping
        "model.override_config={hidden_size: 32}",
    ])
    assert c.actor.optim.lr == 1e-5 and c.actor.optim.weight_decay == 0.3
    assert c.rollout.n == 8 and c.parallel.sequence_parallel is True
    assert c.trainer.total_steps is None and c.actor.grad_clip is None
    assert c.data.truncation == "left" and c.logging.experiment_name == "1e3"
    assert c.reward.kwargs == {"strict": False, "name": "x"}
    assert c.model.override_config == {"hidden_size": 32}


def test_list_overrides():
    c = load_config(None, ["rollout.stop_token_ids=[1,2]", "data.train_files=a.jsonl,b.parquet",
                           "eval.pass_k=1,4", "rollout.stop=[\"</s>\", 'x,y']", "actor.optim.betas=[0.9,0.95]",
                           "data.val_files=[]", "rollout.sglang.extra_args=--foo,3"])
    assert c.rollout.stop_token_ids == [1, 2]
    assert c.data.train_files == ["a.jsonl", "b.parquet"]
    assert c.eval.pass_k == [1, 4]
    assert c.rollout.stop == ["</s>", "x,y"]
    assert c.actor.optim.betas == [0.9, 0.95]
    assert c.data.val_files == []
    assert c.rollout.sglang.extra_args == ["--foo", "3"]


def test_data_files_take_one_path_or_a_list(tmp_path):
    """verl's data.train_files is a path or a list of paths; so are ours, in a recipe and an override."""
    recipe = write(tmp_path, "r.yaml", "data:\n  train_files: a.parquet\n  val_files: [b.jsonl, c.jsonl]\n")
    c = load_config(recipe, [])
    assert (c.data.train_files, c.data.val_files) == (["a.parquet"], ["b.jsonl", "c.jsonl"])
    assert load_config(recipe, ["data.val_files=d.jsonl"]).data.val_files == ["d.jsonl"]
    # other list fields stay strict: one string is not silently a list there
    assert error_of(load_config, write(tmp_path, "s.yaml", "rollout:\n  stop_token_ids: 5\n"), []).startswith(
        "rollout.stop_token_ids: expected a list of int, got 5")


def test_section_override_merges_and_later_override_wins(tmp_path):
    recipe = write(tmp_path, "r.yaml", "actor:\n  optim: {lr: 0.1, weight_decay: 0.3}\n")
    c = load_config(recipe, ["actor.optim={lr: 0.5}", "rollout.n=3", "rollout.n=6"])
    assert (c.actor.optim.lr, c.actor.optim.weight_decay) == (0.5, 0.3)
    assert c.rollout.n == 6
    # a free-form mapping field is replaced whole (so keys can be removed)
    tiny = load_config("tiny_cpu", ["model.override_config={num_hidden_layers: 4}"])
    assert tiny.model.override_config == {"num_hidden_layers": 4}


def test_override_errors():
    assert error_of(load_config, None, ["actor.clip_ratio_hi=0.3"]) == (
        "unknown key 'actor.clip_ratio_hi' (override 'actor.clip_ratio_hi=0.3'); "
        "did you mean 'actor.clip_ratio_high'?")
    assert error_of(load_config, None, ["rollout.n=two"]) == (
        "rollout.n: expected int, got 'two' (str) (override 'rollout.n=two')")
    assert error_of(load_config, None, ["rollout.n=null"]) == (
        "rollout.n: expected int, got null (override 'rollout.n=null')")
    assert error_of(load_config, None, ["eval.pass_k=1,x"]) == (
        "eval.pass_k[1]: expected int, got 'x' (str) (override 'eval.pass_k=1,x')")
    assert error_of(load_config, None, ["data.truncation=middle"]).startswith(
        "data.truncation: expected one of 'error', 'left', 'right', 'filter', got 'middle'")
    assert error_of(load_config, None, ["rollout.n"]) == (
        "override 'rollout.n' is not of the form key=value (e.g. actor.optim.lr=1e-6)")
    assert error_of(load_config, None, ["actor..lr=1"]).startswith("override 'actor..lr=1' is not")
    assert error_of(load_config, None, ["rollout.n.x=1"]) == (
        "'rollout.n' is a single value, not a section: cannot set 'rollout.n.x' (override 'rollout.n.x=1')")
    assert error_of(load_config, None, ["actor.optim.betas=[0.9"]).startswith("value is not valid YAML: ")
    # an unset shell variable (`trainer.total_steps=$STEPS`) would otherwise mean "no limit"
    assert error_of(load_config, None, ["trainer.total_steps="]) == (
        "override 'trainer.total_steps=' has no value (an unset shell variable?): write trainer.total_steps=null "
        "for none, trainer.total_steps=[] for an empty list, trainer.total_steps='' for an empty string")
    assert error_of(load_config, None, ["data.val_files= "]).startswith("override 'data.val_files= ' has no value")
    assert load_config(None, ["logging.experiment_name=''"]).logging.experiment_name == ""


# ---------------------------------------------------------------- round trip


def test_to_yaml_round_trips(tmp_path):
    config = load_config("tiny_cpu", [
        "actor.optim.lr=1e-6", "logging.experiment_name=007", "rollout.stop=[\"\\n\\n\", 'null']",
        "reward.kwargs={a: [1, 2.5, null], b: {c: 'yes'}}", "checkpoint.keep_last=3",
        "rollout.sglang.extra_args=[--x, '1']", "actor.tis_cap=2", "model.tokenizer_path=/t/ok: yes",
    ])
    assert config.rollout.stop == ["\n\n", "null"] and config.logging.experiment_name == "007"
    text = to_yaml(config)
    path = tmp_path / "shown.yaml"
    path.write_text(text)
    assert load_config(path) == config
    assert config_from_dict(yaml.safe_load(text)) == config
    assert to_dict(config) == json.loads(json.dumps(to_dict(config)))  # plain JSON-able data


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().rollout.n = 3  # type: ignore[misc]


# ---------------------------------------------------------------- cross-field validation


def test_valid_base_passes():
    validate(valid(), world_size=4)


@pytest.mark.parametrize("overrides, expected", [
    (["parallel.tensor=3"], "the model's 8 attention heads are not divisible by parallel.tensor=3"),
    (["model.override_config.num_key_value_heads=2", "parallel.tensor=4"],
     "the model's 2 query groups (num_key_value_heads) are not divisible by parallel.tensor=4"),
    (["parallel.pipeline=3"], "the model's 4 layers are not divisible by parallel.pipeline x virtual_pipeline = 3 x 1"),
    (["parallel.pipeline=2", "parallel.virtual_pipeline=4"],
     "the model's 4 layers are not divisible by parallel.pipeline x virtual_pipeline = 2 x 4"),
    (["parallel.virtual_pipeline=2"], "parallel.virtual_pipeline needs parallel.pipeline >= 2"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel=true needs parallel.tensor >= 2"),
    (["rollout.n=1"], "algorithm.adv_estimator=grpo needs rollout.n >= 2 samples per prompt "
                      "(got 1; verl's GRPO examples use 5)"),
    (["algorithm.adv_estimator=rloo", "rollout.n=1"], "algorithm.adv_estimator=rloo needs rollout.n >= 2"),
    (["actor.ppo_mini_batch_size=5"], "data.train_batch_size=16 is not divisible by actor.ppo_mini_batch_size=5"),
    (["actor.clip_ratio_low=1.0"], "actor.clip_ratio_low=1.0 must be in [0, 1)"),
    (["actor.clip_ratio_high=-0.1"], "actor.clip_ratio_high=-0.1 must be in [0, 1)"),
    (["actor.clip_ratio_c=1"], "actor.clip_ratio_c=1.0 must be > 1 (dual-clip bound)"),
    (["actor.ppo_micro_batch_size_per_gpu=2"], "set exactly one of actor.ppo_micro_batch_size_per_gpu and "
                                               "actor.max_tokens_per_micro_batch (got 2 and 16384; null the other)"),
    (["actor.max_tokens_per_micro_batch=null"], "set exactly one of"),
    (["actor.max_tokens_per_micro_batch=100"], "actor.max_tokens_per_micro_batch=100 is below the longest sequence"),
    (["rollout.temperature=0"], "rollout.temperature=0.0 must be > 0"),
    (["rollout.max_new_tokens=600"], "rollout.max_new_tokens=600 must be in [1, data.max_response_length=512]"),
    (["actor.optim.min_lr=1"], "actor.optim.min_lr=1.0 must be in [0, lr=1e-06]"),
    (["actor.optim.betas=[0.9]"], "actor.optim.betas=[0.9] must be two numbers in [0, 1)"),
    (["reward.function=nocolon"], "reward.function='nocolon' is not a known built-in reward function "
                                  "(known: by_data_source, gsm8k, math, synthetic); or 'pkg.module:fn'"),
    (["reward.function=gsm8K"], "reward.function='gsm8K' is not a known built-in reward function; did you "
                                "mean 'gsm8k'?"),
    (["reward.max_error_frac=1.5"], "reward.max_error_frac=1.5 must be in [0, 1] (1 = never stop)"),
    (["algorithm.adv_estimator=grpoo"], "algorithm.adv_estimator='grpoo' is not a known advantage estimator; "
                                        "did you mean 'grpo'? (known: grpo, reinforce_plus_plus_baseline, rloo)"),
    (["algorithm.adv_estimator=gae"], "algorithm.adv_estimator='gae': verl's advantage estimator 'gae' is not "
                                      "available here (GAE needs a critic (PPO); this trainer has none)"),
    (["actor.policy_loss.loss_mode=gspoo"], "actor.policy_loss.loss_mode='gspoo' is not a known policy loss; "
                                            "did you mean 'gspo'? (known: gspo, vanilla)"),
    (["model.dtype=float16"], "model.dtype=float16 is not supported: the trainer runs float32 or bfloat16"),
    (["eval.n_samples=4"], "eval.greedy=true gives 4 identical samples"),
    (["eval.greedy=false", "eval.n_samples=2", "eval.pass_k=[1,4]"],
     "eval.pass_k=[1, 4]: each k must be in [1, eval.n_samples=2]"),
    (["data.task=null"], "no training data: set data.train_files or data.task"),
    (["model.override_config={}"], "no model: set model.path"),
    (["checkpoint.save_interval=0"], "checkpoint.save_interval=0 must be -1 (off) or >= 1"),
    (["rollout.engine=sglang", "rollout.sglang.urls=localhost:30000"],
     "rollout.sglang.urls: 'localhost:30000' must start with http:// or https://"),
    (["rollout.engine=sglang", "rollout.sglang.mem_fraction=1.5"], "rollout.sglang.mem_fraction=1.5 must be in (0, 1]"),
])
def test_cross_field_checks(overrides, expected):
    message = error_of(validate, valid(*overrides))
    assert message.startswith(expected) or f": {expected}" in message or f"; {expected}" in message, message


def test_heads_read_from_hf_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 12, "num_key_value_heads": 2, "num_hidden_layers": 6}))
    config = load_config(None, [*VALID, f"model.path={tmp_path}", "model.override_config={}"])
    validate(config)
    assert "12 attention heads are not divisible by parallel.tensor=8" in error_of(
        validate, dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, tensor=8)))
    assert error_of(validate, dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, tensor=3))
                    ) == "the model's 2 query groups (num_key_value_heads) are not divisible by parallel.tensor=3"
    (tmp_path / "config.json").write_text("{not json")
    assert error_of(validate, config).startswith(f"cannot read the model config {tmp_path / 'config.json'}")


def test_world_size_checks():
    config = valid("parallel.tensor=2")  # mini-batch = 8 prompts x 4 = 32 sequences
    validate(config, world_size=8)  # dp 4 -> 8 per rank
    assert error_of(validate, config, world_size=3) == (
        "world size 3 is not divisible by parallel.tensor x pipeline x context = 2 x 1 x 1")
    assert error_of(validate, valid("parallel.tensor=2", "actor.ppo_mini_batch_size=1", "data.train_batch_size=3",
                                    "rollout.n=3"), world_size=4) == (
        "a mini-batch of actor.ppo_mini_batch_size x rollout.n = 3 sequences is not divisible by the "
        "data-parallel size 2")
    micro = valid("actor.ppo_micro_batch_size_per_gpu=3", "actor.max_tokens_per_micro_batch=null")
    validate(micro)  # without a world size the micro-batch split is not checked
    assert error_of(validate, micro, world_size=4) == (
        "8 sequences per data-parallel rank per mini-batch are not divisible by actor.ppo_micro_batch_size_per_gpu=3")


COLOCATED = ["rollout.engine=sglang", "rollout.sglang.weight_sync=tensor"]


def test_colocated_placement_checks_at_config_time():
    """weight_sync=tensor puts each engine TP rank on a trainer GPU: checked with the world size
    (and the ranks per node) before anything starts, as `config show --world-size` and every
    trainer rank check it."""
    urls = "rollout.sglang.urls=[http://a:1,http://a:2,http://b:1,http://b:2]"
    validate(valid(*COLOCATED, urls), world_size=4, ranks_per_node=2)  # 2 engines on each of 2 nodes
    validate(valid(*COLOCATED, urls), world_size=8, ranks_per_node=8)  # 4 engines on 8 GPUs: GPUs 4-7 host none
    assert error_of(validate, valid(*COLOCATED, urls), world_size=2) == (
        "4 colocated engine(s) x rollout.sglang.tp_size=1 (rollout.sglang.weight_sync=tensor: every engine GPU is "
        "a trainer GPU) need 4 GPUs; the trainer has 2 ranks")
    assert "tp_size 4 does not divide the 6 trainer GPUs of a node" in error_of(
        validate, valid(*COLOCATED, "rollout.sglang.tp_size=4"), world_size=12, ranks_per_node=6)
    assert "engines launched by the trainer run on rank 0's node, which has 4 trainer GPUs" in error_of(
        validate, valid(*COLOCATED, "rollout.sglang.num_engines=8"), world_size=8, ranks_per_node=4)
    assert "weight_sync_route=colocated feeds SGLang engines on the trainer's GPUs" in error_of(
        validate, valid("rollout.engine=sglang", "rollout.weight_sync_route=colocated"))


def test_shipped_cluster_recipes_validate_at_their_layout():
    """Each sbatch recipe at the world size and GPUs per node of its script's #SBATCH header."""
    for recipe, nodes, per_node in (("qwen3_8b_gsm8k", 1, 8), ("qwen3_8b_gsm8k_tool", 1, 8),
                                    ("qwen3_32b_math", 2, 8), ("llama3_70b_gsm8k", 4, 8),
                                    ("qwen3_30b_a3b_gsm8k", 2, 8)):
        validate(load_config(recipe), world_size=nodes * per_node, ranks_per_node=per_node)


def test_a_router_for_servers_given_by_url_needs_its_url():
    assert "give the running router's rollout.sglang.router_url" in error_of(
        validate, valid("rollout.engine=sglang", "rollout.sglang.router=true", "rollout.sglang.urls=[http://a:1]"))
    validate(valid("rollout.engine=sglang", "rollout.sglang.router=true", "rollout.sglang.urls=[http://a:1]",
                   "rollout.sglang.router_url=http://r:2"))


MOE = ["model.override_config.model_type=qwen3_moe", "model.override_config.num_experts=8"]


def test_moe_keys_need_a_moe_model(tmp_path):
    validate(valid(*MOE, "parallel.expert=2", "actor.moe_routing_replay=true",
                   "actor.max_tokens_per_micro_batch=null", "actor.ppo_micro_batch_size_per_gpu=4"), world_size=2)
    assert error_of(validate, valid("model.override_config.model_type=qwen3", "parallel.expert=2",
                                    "parallel.pipeline=2")) == (
        "parallel.expert=2: model_type 'qwen3' has no experts (expert parallelism needs a mixture-of-experts "
        "model); set parallel.expert=1")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": 8,
                                                      "num_hidden_layers": 4}))
    assert error_of(validate, valid(f"model.path={tmp_path}", "model.override_config={}",
                                    "actor.moe_routing_replay=true")) == (
        "actor.moe_routing_replay=true: model_type 'llama' has no experts (routing replay needs a "
        "mixture-of-experts model); set it to false")


MOE_SIZES = [*MOE, "model.override_config.num_experts_per_tok=2", "model.override_config.moe_intermediate_size=64"]


@pytest.mark.parametrize("overrides, world_size, expected", [
    (["model.override_config.num_experts=0"], None, "num_experts=0 in model.override_config must be >= 1 "
                                                    "(model_type 'qwen3_moe' is a mixture-of-experts model)"),
    (["model.override_config.num_experts_per_tok=0"], None, "num_experts_per_tok=0 in model.override_config must be"),
    (["model.override_config.moe_intermediate_size=0"], None, "moe_intermediate_size=0 in model.override_config"),
    (["model.override_config.num_experts_per_tok=9"], None, "num_experts_per_tok=9 in model.override_config must be "
                                                            "<= num_experts=8"),
    (["parallel.expert=3"], None,
     "parallel.expert=3 does not divide the model's num_experts=8 (model.override_config)"),
    # zeros the divisibility checks divided by (a ZeroDivisionError before)
    (["parallel.expert=0"], 2, "parallel.expert=0 must be >= 1"),
    (["parallel.tensor=0"], 2, "parallel.tensor=0 must be >= 1"),
    (["parallel.pipeline=0"], None, "parallel.pipeline=0 must be >= 1"),
])
def test_moe_sizes_and_zero_parallel_sizes_are_refused_with_key_and_value(overrides, world_size, expected):
    message = error_of(validate, valid(*MOE_SIZES, *overrides), world_size=world_size)
    assert message == expected or message.startswith(expected) or f"; {expected}" in message, message


def test_moe_sizes_of_a_config_json_name_the_file(tmp_path):
    config = {"model_type": "qwen3_moe", "num_attention_heads": 8, "num_hidden_layers": 4, "num_experts": 8,
              "num_experts_per_tok": 2, "moe_intermediate_size": 0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert error_of(validate, valid(f"model.path={tmp_path}", "model.override_config={}")) == (
        f"moe_intermediate_size=0 in {tmp_path / 'config.json'} must be >= 1 (model_type 'qwen3_moe' is a "
        "mixture-of-experts model)")
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "qwen3", "moe_intermediate_size": 64,
                                                      "num_experts": 0}))
    validate(valid(f"model.path={tmp_path}", "model.override_config={}"))  # a dense model's 0: not an MoE size


def test_multi_turn_keys_without_an_environment_are_refused():
    assert error_of(validate, valid("rollout.multi_turn.max_turns=8", "rollout.multi_turn.max_length=4096")) == (
        "rollout.multi_turn.environment is not set (multi-turn is off), but rollout.multi_turn.max_turns=8, "
        "rollout.multi_turn.max_length=4096 are set and would have no effect: set rollout.multi_turn.environment "
        "or leave them out")


def test_a_warmup_as_long_as_the_run_is_a_warning(capsys):
    """lr_warmup_steps >= the run's steps: the LR never reaches actor.optim.lr. A warning (a short try of
    a recipe with its warmup is legitimate), from config show and from the trainer once the run's
    length is known (trainer.total_epochs: from the prompts)."""
    from megatron_grpo.cli import main
    from megatron_grpo.config.validate import config_warnings

    warmup = valid("actor.optim.lr_warmup_steps=10", "actor.optim.lr_scheduler=cosine")
    validate(warmup)
    assert config_warnings(warmup) == []  # total_epochs: the length is not known before the prompts are
    assert config_warnings(warmup, total_steps=10) == [
        "actor.optim.lr_warmup_steps=10 >= the run's 10 steps: the whole run is warmup, the learning rate rises "
        "from 0 and never reaches actor.optim.lr=1e-06 (the cosine decay never starts)"]
    assert config_warnings(warmup, total_steps=11) == []
    assert main(["config", "show", "tiny_cpu", "actor.optim.lr_warmup_steps=5", "trainer.total_steps=3"]) == 0
    assert capsys.readouterr().err.startswith("warning: actor.optim.lr_warmup_steps=5 >= the run's 3 steps")


def test_dense_model_types_are_the_architectures_without_experts():
    from megatron_grpo.config.validate import DENSE_MODEL_TYPES
    from megatron_grpo.models.architectures import ARCHITECTURES

    assert set(DENSE_MODEL_TYPES) == {name for name, spec in ARCHITECTURES.items() if not spec.moe}


def test_expert_parallel_takes_token_budgets_at_any_pipeline_size():
    """The planner equalises micro-batch counts over DP ranks at EP > 1 (tests/test_packing.py)."""
    for pipeline in (1, 2):
        validate(valid(*MOE, "parallel.expert=2", f"parallel.pipeline={pipeline}",
                       "actor.logprob_max_tokens_per_micro_batch=2048"))


def test_expert_world_size_checks():
    config = valid(*MOE, "parallel.expert=4", "parallel.tensor=2", "parallel.expert_tensor=1",
                   "actor.max_tokens_per_micro_batch=null", "actor.ppo_micro_batch_size_per_gpu=4")
    validate(config, world_size=4)  # EP 4 x ETP 1 carved out of TP 2 x DP 2
    assert error_of(validate, config, world_size=6) == (
        "world size 6 is not divisible by parallel.expert x expert_tensor x pipeline = 4 x 1 x 1")


def test_all_problems_in_one_message():
    message = error_of(validate, valid("rollout.n=1", "actor.clip_ratio_c=0.5"))
    assert message.startswith("2 config problems: algorithm.adv_estimator=grpo needs rollout.n >= 2")
    assert "; actor.clip_ratio_c=0.5 must be > 1" in message


# ---------------------------------------------------------------- verl habits, registry-backed names


def test_defaults_found_in_shipped_recipes_when_not_next_to_the_recipe(tmp_path):
    """A user recipe outside recipes/ builds on the shipped base.yaml / tiny_cpu.yaml by name; a
    file next to the recipe still comes first."""
    recipe = write(tmp_path, "mine.yaml", "defaults: [tiny_cpu.yaml]\ntrainer: {total_steps: 3}\n")
    config = load_config(recipe)
    assert config.trainer.total_steps == 3
    assert config == load_config("tiny_cpu", ["trainer.total_steps=3"])
    write(tmp_path, "tiny_cpu.yaml", "rollout: {n: 7}\n")
    assert load_config(recipe).rollout.n == 7 and load_config(recipe).data.task is None


def test_straight_through_kl_names_are_accepted():
    for name in ("low_var_kl+", "k3+", "k1+", "abs+", "mse+", "k2+", "kl+"):
        validate(valid(f"actor.kl_loss_type={name}"))
    assert error_of(load_config, None, ["actor.kl_loss_type=low_var"]).endswith("did you mean 'low_var_kl'?")


def test_builtin_names_equal_the_registries():
    """config/names.py lists the registries' built-in names so that config checks need no torch."""
    from megatron_grpo.algo import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
    from megatron_grpo.algo.kl import kl_estimator_names
    from megatron_grpo.config import names
    from megatron_grpo.config.schema import KlEstimator
    from megatron_grpo.rewards.loader import BUILTIN_REWARDS
    import typing

    assert list(names.ADVANTAGE_ESTIMATORS.builtin) == ADVANTAGE_ESTIMATORS.names()
    assert list(names.POLICY_LOSSES.builtin) == POLICY_LOSSES.names()
    assert list(names.REWARD_FUNCTIONS.builtin) == sorted(BUILTIN_REWARDS)
    assert sorted(typing.get_args(KlEstimator)) == sorted(kl_estimator_names())
    assert not set(names.ADVANTAGE_ESTIMATORS.verl_only) & set(ADVANTAGE_ESTIMATORS.names())
    assert not set(names.POLICY_LOSSES.verl_only) & set(POLICY_LOSSES.names())


def test_registered_names_count_once_registered():
    import megatron_grpo.algo.advantages as advantages

    assert "my_estimator_for_test" not in advantages.ADVANTAGE_ESTIMATORS
    advantages.register_advantage_estimator("my_estimator_for_test")(advantages.grpo_advantage)
    try:
        validate(valid("algorithm.adv_estimator=my_estimator_for_test"))
    finally:
        del advantages.ADVANTAGE_ESTIMATORS._entries["my_estimator_for_test"]
    assert "not a known advantage estimator" in error_of(
        validate, valid("algorithm.adv_estimator=my_estimator_for_test"))


# ---------------------------------------------------------------- keys the trainer does not act on yet


def test_settings_not_yet_wired_are_refused_at_config_time():
    message = error_of(validate, valid("actor.shuffle=true", "logging.log_interval=5"))
    assert message.startswith("not implemented in the trainer yet, set back to the default: "
                              "actor.shuffle=True (default False); logging.log_interval=5 (default 1)")
    validate(valid())  # every unwired key at its default
    validate(valid("ref.max_tokens_per_micro_batch=4096"))  # wired (the reference pass's own budget)


def test_attention_backend_replaces_transformer_impl_and_checks_the_recipe():
    """model.attention_backend (models/spec.py) is the one key for the attention / layer spec: the
    old model.transformer_impl names its replacement; what only the node can say (TE imports, CUDA,
    torch's varlen_attn) is checked when the model is built (tests/test_torch_varlen.py)."""
    assert Config().model.attention_backend == "auto"
    assert error_of(load_config, None, ["model.transformer_impl=local"]) == (
        "unknown key 'model.transformer_impl' (override 'model.transformer_impl=local'): replaced by "
        "model.attention_backend: auto | te | torch_varlen | local (transformer_engine -> te, local -> local)")
    assert "did you mean 'model.attention_backend'" not in error_of(load_config, None,
                                                                      ["model.transformer_impl=transformer_engine"])
    assert "one of 'auto', 'te', 'torch_varlen', 'local'" in error_of(load_config, None,
                                                                     ["model.attention_backend=flash"])
    for backend in ("auto", "te", "torch_varlen", "local"):
        validate(valid(f"model.attention_backend={backend}"))
    assert error_of(validate, valid("model.attention_backend=torch_varlen", "trainer.device=cpu")) == (
        "model.attention_backend=torch_varlen needs CUDA (torch's FlashAttention varlen kernel), but "
        "trainer.device=cpu: set model.attention_backend=local (or auto)")
    assert error_of(validate, valid("model.attention_backend=te", "trainer.device=cpu")).startswith(
        "model.attention_backend=te needs CUDA (Transformer Engine)")
    assert error_of(validate, valid("model.attention_backend=torch_varlen", "model.dtype=float32")).startswith(
        "model.attention_backend=torch_varlen needs model.dtype=bfloat16 (or auto on GPU)")
    validate(valid("model.attention_backend=local", "trainer.device=cpu", "model.dtype=float32"))
    validate(valid("model.attention_backend=torch_varlen", "parallel.context=2"))  # CP included


def _config_reads(tree) -> set[tuple[str, str]]:
    """(section, key) of every `<...>.section.key` attribute read in a module."""
    import ast

    reads = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            reads.add((node.value.attr, node.attr))
    return reads


def test_not_yet_wired_keys_are_read_nowhere_in_the_package():
    """The list ties to the code: a key that something outside config/ reads is wired and must
    leave NOT_YET_WIRED (ref.max_tokens_per_micro_batch was still listed after the packing
    planner started reading it, so setting it stopped every run)."""
    import ast

    from megatron_grpo.config.validate import NOT_YET_WIRED

    package = Path(__file__).resolve().parents[1] / "megatron_grpo"
    reads = set()
    for path in package.rglob("*.py"):
        if "config" not in path.relative_to(package).parts[:1]:
            reads |= _config_reads(ast.parse(path.read_text()))
    defaults = Config()
    for key in NOT_YET_WIRED:
        *sections, leaf = key.split(".")
        value = defaults
        for part in key.split("."):
            value = getattr(value, part)  # every listed key exists in the schema
        assert (sections[-1], leaf) not in reads, f"{key} is read outside config/: remove it from NOT_YET_WIRED"


def test_loss_agg_modes_equal_the_algorithms():
    """config/schema.py spells the modes as a Literal (no torch import); algo/ is the source."""
    import typing

    from megatron_grpo.algo import LOSS_AGG_MODES
    from megatron_grpo.config.schema import LossAggMode

    assert typing.get_args(LossAggMode) == LOSS_AGG_MODES


@pytest.mark.parametrize("key, value", [("n", 0), ("n", 1), ("top_p", 0.0), ("top_p", 1.0), ("top_p", 1.5),
                                        ("top_k", -2), ("top_k", -1), ("top_k", 0), ("top_k", 1),
                                        ("temperature", -0.5), ("temperature", 0.5), ("min_p", -0.1),
                                        ("min_p", 0.0), ("min_p", 0.05), ("min_p", 1.0)])
def test_rollout_ranges_equal_the_engines(key, value):
    """Validation refuses a rollout setting exactly when the engines' SamplingParams would (so a
    recipe never passes validation to fail at the first generation); the one difference is
    temperature 0, greedy for an engine but refused for training (log-probs of logits / T)."""
    from megatron_grpo.rollout.types import SamplingParams

    try:
        SamplingParams(**{key: value})
        engine_ok = True
    except ValueError:
        engine_ok = False
    try:
        validate(valid(f"rollout.{key}={value}", *(["algorithm.adv_estimator=reinforce_plus_plus_baseline"]
                                                   if key == "n" else [])))
        config_ok = True
    except ConfigError:
        config_ok = False
    assert config_ok == engine_ok
    assert error_of(validate, valid("rollout.temperature=0")).startswith("rollout.temperature=0.0 must be > 0")


def test_routing_replay_with_sglang_is_refused_only_behind_a_router():
    """The client reads SGLang's return_routed_experts (tests/test_sglang_routing_replay.py);
    sglang-router 0.3.2 drops the field."""
    moe = ["model.override_config.model_type=qwen3_moe", "model.override_config.num_experts=8",
           "actor.moe_routing_replay=true"]
    validate(valid(*moe))
    validate(valid(*moe, "rollout.engine=sglang"))
    message = error_of(validate, valid(*moe, "rollout.engine=sglang", "rollout.sglang.router=true"))
    assert message.startswith("actor.moe_routing_replay=true with the sglang-router")


def test_sampling_replay_follows_truncation_and_the_engine():
    """auto = on exactly when sampling is truncated; SGLang needs a finite top_k for the supports
    (return_sampling_mask); on without truncation, and replay with multi-turn, are refused."""
    from megatron_grpo.config.derived import implied_settings, sampling_replay_enabled

    assert not sampling_replay_enabled(valid())
    for truncation in ("rollout.top_p=0.9", "rollout.top_k=20", "rollout.min_p=0.05"):
        assert sampling_replay_enabled(valid(truncation)), truncation
        assert not sampling_replay_enabled(valid(truncation, "rollout.sampling_replay=off"))
    assert any("sampling replay: on" in line for line in implied_settings(valid("rollout.top_k=20")))
    with pytest.raises(ConfigError, match="rollout.sampling_replay=on but sampling is not truncated"):
        validate(valid("rollout.sampling_replay=on"))
    with pytest.raises(ConfigError, match=r"needs rollout.top_k in \[2, 4096\] with SGLang, got -1"):
        validate(valid("rollout.engine=sglang", "rollout.sglang.urls=[http://127.0.0.1:1]", "rollout.top_p=0.9"))
    validate(valid("rollout.engine=sglang", "rollout.sglang.urls=[http://127.0.0.1:1]", "rollout.top_p=0.9",
                   "rollout.top_k=50"))
    validate(valid("rollout.engine=sglang", "rollout.sglang.urls=[http://127.0.0.1:1]", "rollout.top_p=0.9",
                   "rollout.sampling_replay=off"))
    with pytest.raises(ConfigError, match="not supported with rollout.multi_turn"):
        validate(valid("rollout.top_k=20", "rollout.sampling_replay=on", "rollout.multi_turn.environment=lookup"))
    with pytest.raises(ConfigError, match="with rollout.top_k=1: every support is one token"):
        validate(valid("rollout.top_k=1", "rollout.sampling_replay=on"))
    # auto leaves both off: multi-turn, and the one-token supports of top_k=1 (greedy-like sampling)
    assert not sampling_replay_enabled(valid("rollout.top_k=20", "rollout.multi_turn.environment=lookup"))
    assert not sampling_replay_enabled(valid("rollout.top_k=1"))
    # sglang-router 0.3.2 drops return_sampling_mask; SGLang's deterministic sampler dies on min_p
    with pytest.raises(ConfigError, match="the router drops return_sampling_mask"):
        validate(valid("rollout.engine=sglang", "rollout.top_k=20", "rollout.sglang.router=true"))
    with pytest.raises(ConfigError, match="rollout.min_p=0.1 with rollout.sglang.deterministic_inference=true"):
        validate(valid("rollout.engine=sglang", "rollout.top_k=20", "rollout.min_p=0.1",
                       "rollout.sglang.deterministic_inference=true"))


def test_off_policy_correction_defaults_to_token_tis_when_rollouts_run_ahead():
    """actor.off_policy.is_level=auto: token TIS exactly when max_staleness > 0 and nothing else
    corrects; null is off at any K; what auto chose is printed by `config show`."""
    from megatron_grpo.config.derived import implied_settings
    from megatron_grpo.trainer.step_settings import grpo_loss_config

    def level(*overrides):
        return grpo_loss_config(valid(*overrides)).off_policy.is_level

    assert level() is None
    assert level("rollout.max_staleness=1") == "token"
    assert level("rollout.max_staleness=2", "actor.off_policy.is_cap=3.0") == "token"
    assert level("rollout.max_staleness=1", "actor.off_policy.is_level=null") is None
    assert level("rollout.max_staleness=1", "actor.tis_cap=2.0") is None  # tis_cap is token TIS itself
    assert level("rollout.max_staleness=1", "actor.off_policy.rs_level=token") is None
    assert level("rollout.max_staleness=1", "actor.off_policy.objective=behaviour") is None
    assert level("rollout.max_staleness=1", "actor.off_policy.is_level=sequence") == "sequence"
    assert any("is_level=auto: token-level truncated IS" in line
               for line in implied_settings(valid("rollout.max_staleness=1")))
    validate(valid("rollout.max_staleness=1", "actor.tis_cap=2.0"))  # auto does not clash with tis_cap
