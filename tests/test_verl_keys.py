"""verl keys, both ways: the table against verl 0.9.1's key lists, `config from-verl` on verl's own
example command lines and YAML, "verl's X is Y here" for verl keys given to config show / train,
and the table `config verl-keys` prints (docs/verl.md)."""
from __future__ import annotations

import fnmatch
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from megatron_grpo.cli import main
from megatron_grpo.config import load_config, validate
from megatron_grpo.config.coerce import all_keys
from megatron_grpo.config.from_verl import (config_of, markdown_table, parse_command_line, parse_value,
                                            read_verl, render_recipe, translate)
from megatron_grpo.config.schema import Config
from megatron_grpo.config.verl_keys import TABLE, hint, lookup

REPO = Path(__file__).resolve().parents[1]
KEY_LISTS = {name: REPO / "tests" / "data" / f"verl_0.9.1_{name}_keys.txt"
             for name in ("ppo_trainer", "ppo_megatron_trainer")}


def verl_keys(name: str) -> list[str]:
    return [line.strip() for line in KEY_LISTS[name].read_text().splitlines()
            if line.strip() and not line.startswith("#")]


ALL_VERL_KEYS = sorted(set(verl_keys("ppo_trainer")) | set(verl_keys("ppo_megatron_trainer")))

# verl's GRPO GSM8K example with Qwen3-8B (examples/grpo_trainer/run_qwen3-8b.sh), as verl writes it.
SEED_EXAMPLE = r"""python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.val_files=$HOME/data/gsm8k/test.parquet \
    data.train_batch_size=1024 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=Qwen/Qwen3-8B \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name='verl_grpo_example_gsm8k' \
    trainer.experiment_name='qwen3_8b_function_rm' \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 $@"""


def seed_args(home: str = "/home/u") -> list[str]:
    """The seed example's arguments as the shell passes them ($HOME expanded, quotes removed)."""
    return shlex.split(SEED_EXAMPLE.replace("\\\n", " ").replace("$HOME", home))


# ---------------------------------------------------------------- the table vs verl's key lists


def test_key_lists_are_verl_0_9_1_files_with_their_source():
    for name, path in KEY_LISTS.items():
        header = [line for line in path.read_text().splitlines() if line.startswith("#")]
        assert f"verl's {name}.yaml" in header[0] and "verl 0.9.1" in header[1] and "sha256" in header[1]
        assert f"{len(verl_keys(name))} keys" in header[2]
    assert len(verl_keys("ppo_trainer")) == 898 and len(verl_keys("ppo_megatron_trainer")) == 942


@pytest.mark.parametrize("name", sorted(KEY_LISTS))
def test_every_verl_key_has_a_row(name):
    missing = [key for key in verl_keys(name) if lookup(key) is None]
    assert not missing, f"{len(missing)} verl keys of {name} have no row: {missing[:20]}"


def test_every_row_matches_verl_keys_or_says_it_is_added():
    """No row for a key verl does not have (a typo), unless it is a key users add with `+key=`
    or one of an older verl (marked added=True)."""
    for row in TABLE:
        matched = [k for k in ALL_VERL_KEYS if (fnmatch.fnmatchcase(k, row.verl) if row.is_pattern else k == row.verl)]
        assert bool(matched) != row.added, (row.verl, row.added, matched[:3])


def test_rows_name_our_keys_and_explain_the_rest():
    ours = set(all_keys(Config))
    exact = [row.verl for row in TABLE if not row.is_pattern]
    assert len(exact) == len(set(exact)), "an exact verl key has two rows"
    for row in TABLE:
        assert set(row.ours) <= ours, (row.verl, set(row.ours) - ours)
        assert row.ours or row.note, f"{row.verl}: no equivalent and no reason"


def test_every_key_with_a_meaning_here_translates():
    """The keys the issue names, and every verl key whose concept exists here, map to our keys."""
    expected = {
        "actor_rollout_ref.actor.optim.lr": "actor.optim.lr", "trainer.save_freq": "checkpoint.save_interval",
        "trainer.test_freq": "eval.interval", "trainer.total_training_steps": "trainer.total_steps",
        "actor_rollout_ref.rollout.name": "rollout.engine",
        "actor_rollout_ref.rollout.gpu_memory_utilization": "rollout.sglang.mem_fraction",
        "data.filter_overlong_prompts": "data.truncation",
        "actor_rollout_ref.actor.use_dynamic_bsz": "actor.max_tokens_per_micro_batch",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "actor.max_tokens_per_micro_batch",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": "parallel.tensor",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": "parallel.pipeline",
        "actor_rollout_ref.actor.megatron.context_parallel_size": "parallel.context",
        "custom_reward_function.path": "reward.function", "reward.custom_reward_function.path": "reward.function",
        "trainer.project_name": "logging.project", "trainer.max_actor_ckpt_to_keep": "checkpoint.keep_last",
        "actor_rollout_ref.model.tokenizer_path": "model.tokenizer_path",
        "actor_rollout_ref.ref.megatron.param_offload": "ref.param_offload",
        "actor_rollout_ref.rollout.val_kwargs.n": "eval.n_samples",
        "algorithm.rollout_correction.rollout_is": "actor.tis_cap",
    }
    for verl, ours in expected.items():
        assert ours in lookup(verl).ours, verl
    # a verl key with our key's name and section (data.*, algorithm.*, trainer.*) translates
    same_name = [k for k in ALL_VERL_KEYS if k in set(all_keys(Config)) and lookup(k).ours != (k,)]
    assert not same_name, same_name


@pytest.mark.parametrize("args, expected", [
    (["actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576"],
     {"actor.max_tokens_per_micro_batch": 24576, "actor.ppo_micro_batch_size_per_gpu": None}),
    (["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576", "actor_rollout_ref.actor.use_dynamic_bsz=True"],
     {"actor.max_tokens_per_micro_batch": 24576, "actor.ppo_micro_batch_size_per_gpu": None}),  # any order
    (["actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"],
     {"actor.max_tokens_per_micro_batch": 16384, "actor.ppo_micro_batch_size_per_gpu": None}),  # verl's default
    (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"],
     {"actor.ppo_micro_batch_size_per_gpu": 4, "actor.max_tokens_per_micro_batch": None}),
    (["data.truncation=left"], {"data.truncation": "left"}),
    (["data.filter_overlong_prompts=True", "data.truncation='error'"], {"data.truncation": "filter"}),
    (["trainer.save_freq=-1", "trainer.test_freq=0"], {"checkpoint.save_interval": -1, "eval.interval": -1}),
    (["actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
      "trainer.n_gpus_per_node=8", "trainer.nnodes=2"],
     {"rollout.engine": "sglang", "rollout.sglang.num_engines": 4, "rollout.sglang.weight_sync": "tensor"}),
    (["actor_rollout_ref.rollout.name=hf"], {"rollout.engine": "local"}),
    (["trainer.logger=['console','tensorboard']"],
     {"logging.console": True, "logging.wandb": False, "logging.tensorboard": True}),
    (["custom_reward_function.path=~/r.py"], {"reward.function": f"{Path.home()}/r.py:compute_score"}),
    (["custom_reward_function.path=/r.py", "custom_reward_function.name=my_fn",
      "+custom_reward_function.reward_kwargs.scale=2"], {"reward.function": "/r.py:my_fn", "reward.kwargs.scale": 2}),
    (["actor_rollout_ref.actor.clip_ratio=0.3", "actor_rollout_ref.actor.clip_ratio_high=0.28"],
     {"actor.clip_ratio_low": 0.3, "actor.clip_ratio_high": 0.28}),
    (["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1", "trainer.total_training_steps=50"],
     {"actor.optim.lr_warmup_steps": 5, "trainer.total_steps": 50}),
    (["+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=flashinfer"],
     {"rollout.sglang.extra_args": ["--attention-backend", "flashinfer"]}),
    (["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=3"],
     {"actor.tis_cap": 3.0}),
    (["+actor_rollout_ref.model.override_config.attention_dropout=0.0"],
     {"model.override_config.attention_dropout": 0.0}),
    (["+actor_rollout_ref.model.override_config.model_config.max_position_embeddings=10240"],  # verl's megatron form
     {"model.override_config.max_position_embeddings": 10240}),
    (["trainer.experiment_name=12", "actor_rollout_ref.actor.megatron.sequence_parallel=True"],
     {"logging.experiment_name": "12", "parallel.sequence_parallel": False}),  # SP only with TP > 1, as verl
    (["trainer.resume_mode=resume_path", "trainer.resume_from_path=/ck/global_step_10"],
     {"checkpoint.resume": "/ck/global_step_10"}),
    (["actor_rollout_ref.actor.megatron.expert_model_parallel_size=8",
      "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
      "actor_rollout_ref.actor.megatron.router_replay.mode=R3"],
     {"parallel.expert": 8, "parallel.expert_tensor": 1, "actor.moe_routing_replay": True}),
    (["actor_rollout_ref.actor.megatron.router_replay.mode=disabled"], {"actor.moe_routing_replay": False}),
    (["+actor_rollout_ref.actor.router_replay.mode=R3"], {"actor.moe_routing_replay": True}),
    (["actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend=auto"],
     {"model.attention_backend": "auto"}),
    (["actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend=fused"],
     {"model.attention_backend": "te"}),  # a kernel inside Transformer Engine's attention
])
def test_translations(args, expected):
    values = translate(parse_command_line(args)).values
    assert {k: values[k] for k in expected} == expected


def test_values_parse_as_hydra_overrides():
    assert parse_value("1e-6") == 1e-6 and parse_value("'1e-6'") == "1e-6"
    assert parse_value("True") is True and parse_value("null") is None and parse_value("5") == 5
    assert parse_value("['a', 'b']") == ["a", "b"] and parse_value("{a: 1}") == {"a": 1}
    assert parse_value("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B" and parse_value("'error'") == "error"


# ---------------------------------------------------------------- verl's examples


def test_seed_example_translates_to_a_recipe_that_validates(tmp_path):
    translation = translate(parse_command_line(seed_args()))
    config = config_of(translation)
    validate(config)
    assert (config.model.path, config.data.train_files, config.data.val_files) == (
        "Qwen/Qwen3-8B", ["/home/u/data/gsm8k/train.parquet"], ["/home/u/data/gsm8k/test.parquet"])
    assert (config.data.train_batch_size, config.data.max_prompt_length, config.data.max_response_length) == (
        1024, 512, 1024)
    assert config.data.truncation == "filter"
    a = config.actor
    assert (a.optim.lr, a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu, a.max_tokens_per_micro_batch) == (
        1e-6, 256, 32, None)
    assert (a.use_kl_loss, a.kl_loss_coef, a.kl_loss_type, a.entropy_coeff) == (True, 0.001, "low_var_kl", 0.0)
    assert config.algorithm.adv_estimator == "grpo" and config.algorithm.use_kl_in_reward is False
    r = config.rollout
    assert (r.engine, r.n, r.sglang.tp_size, r.sglang.mem_fraction, r.sglang.num_engines) == ("sglang", 5, 2, 0.6, 4)
    assert config.ref.param_offload is True and config.model.recompute_granularity == "full"
    assert (config.trainer.total_epochs, config.checkpoint.save_interval, config.eval.interval) == (15, 20, 5)
    assert (config.logging.project, config.logging.experiment_name) == ("verl_grpo_example_gsm8k",
                                                                        "qwen3_8b_function_rm")
    assert config.logging.wandb and config.logging.console
    # verl's defaults where ours differ: validation before training, the scorer by data_source
    assert config.eval.before_train is True and config.reward.function == "by_data_source"
    # nothing dropped silently: every key given is translated or listed with its reason
    recipe = render_recipe(translation)
    header = "\n".join(line for line in recipe.splitlines() if line.startswith("#"))
    for key, _ in parse_command_line(seed_args()).items:
        assert f"from verl's {key}" in translation.origin.values() or f"{key}=" in header, key
    assert ("trainer.n_gpus_per_node=8, trainer.nnodes=1: the world size comes from the launcher" in recipe)
    assert "actor_rollout_ref.rollout.name=vllm: vllm is not supported here; SGLang colocated" in recipe
    assert "trainer.critic_warmup=0: GRPO-family estimators need no critic" in recipe
    # the printed recipe is a recipe: it loads to the same config
    (tmp_path / "seed.yaml").write_text(recipe)
    assert load_config(tmp_path / "seed.yaml") == config


# verl 0.9's Megatron GRPO example (examples/grpo_trainer/run_qwen3_8b_megatron.sh), its defaults expanded
MEGATRON_EXAMPLE = """algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False
data.train_files="['/d/gsm8k/train.parquet', '/d/math/train.parquet']"
data.val_files="['/d/gsm8k/test.parquet', '/d/math/test.parquet']" data.train_batch_size=1024
data.max_prompt_length=1024 data.max_response_length=2048 data.filter_overlong_prompts=True data.truncation='error'
actor_rollout_ref.model.path="Qwen/Qwen3-8B" actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=256
actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576
actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2
actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2
actor_rollout_ref.rollout.name=sglang actor_rollout_ref.rollout.tensor_model_parallel_size=2
actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24576
actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24576
actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2
actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2
trainer.balance_batch=True trainer.logger='["console","wandb"]' trainer.project_name=verl_grpo_gsm8k_math
trainer.experiment_name=qwen3_8b_sglang_megatron trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=20
trainer.test_freq=5 trainer.total_epochs=15 model_engine=megatron"""


def test_megatron_example_translates_and_validates():
    translation = translate(parse_command_line(shlex.split(MEGATRON_EXAMPLE)))
    config = config_of(translation)
    validate(config)
    assert (config.parallel.tensor, config.parallel.pipeline) == (2, 2)
    assert config.actor.max_tokens_per_micro_batch == 24576 and config.actor.ppo_micro_batch_size_per_gpu is None
    assert config.data.train_files == ["/d/gsm8k/train.parquet", "/d/math/train.parquet"]
    assert (config.rollout.engine, config.rollout.sglang.num_engines) == ("sglang", 4)
    assert config.reward.function == "by_data_source"  # gsm8k and MATH rows, each by its own scorer
    assert translation.unknown == ["model_engine=megatron"]  # a Hydra group choice, listed, not dropped
    assert "model_engine=megatron" in render_recipe(translation)


def test_kl_controller_settings_without_kl_in_reward_are_kept_and_noted_not_refused():
    """verl's MoE DAPO example sets algorithm.kl_ctrl.kl_coef=0.0 with use_kl_in_reward=False:
    inert in verl, so kept here with a note (it was refused, and the script got no recipe)."""
    from megatron_grpo.config.derived import implied_settings

    args = ["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False", "algorithm.kl_ctrl.kl_coef=0.0",
            "algorithm.kl_ctrl.type=adaptive", "data.train_files=/d/train.parquet",
            "actor_rollout_ref.model.path=Qwen/Qwen3-8B", "actor_rollout_ref.rollout.n=5"]
    translation = translate(parse_command_line(args))
    config = config_of(translation)
    validate(config)
    assert (config.algorithm.kl_ctrl.kl_coef, config.algorithm.kl_ctrl.type) == (0.0, "adaptive")
    recipe = render_recipe(translation)
    assert ("algorithm.kl_ctrl.kl_coef=0.0: kept; inert while algorithm.use_kl_in_reward=false, as in verl"
            in recipe), recipe
    assert ("algorithm.kl_ctrl.type='adaptive' has no effect: algorithm.use_kl_in_reward=false (as in verl)"
            in implied_settings(config))
    # with the KL in the reward (verl's RLOO / REINFORCE++ examples) they act: no note, and it validates
    active = translate(parse_command_line([*args, "algorithm.use_kl_in_reward=True",
                                           "algorithm.kl_ctrl.kl_coef=0.001"]))
    validate(config_of(active))
    assert config_of(active).algorithm.use_kl_in_reward and "inert" not in render_recipe(active)
    assert not [line for line in implied_settings(config_of(active)) if "has no effect" in line]


def test_from_verl_cli_takes_the_line_whole_alone_or_as_one_string(tmp_path, capsys):
    outputs = []
    for argv in (seed_args(), seed_args()[3:], [SEED_EXAMPLE.replace("$HOME", "/home/u")]):
        assert main(["config", "from-verl", *argv]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] == outputs[2]
    assert main(["config", "from-verl", "--no-validate", "data.train_files=a.jsonl"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["data"]["train_files"] == ["a.jsonl"]
    assert main(["config", "from-verl", "data.train_files=a.jsonl"]) == 2  # no model: the recipe does not validate
    assert "no model: set model.path" in capsys.readouterr().err


def test_from_verl_reads_a_verl_yaml(tmp_path, capsys):
    verl_yaml = tmp_path / "my_verl.yaml"
    verl_yaml.write_text(textwrap.dedent("""
        hydra:
          searchpath: [file://verl/trainer/config]
        defaults:
          - ppo_trainer
          - _self_
        data:
          train_files: ~/data/train.parquet
          train_batch_size: 64
        actor_rollout_ref:
          model:
            path: /models/qwen
            override_config: {attention_dropout: 0.0}
          actor:
            ppo_mini_batch_size: 16
            use_dynamic_bsz: true
            optim: {lr: 3.0e-06}
          rollout:
            name: sglang
            n: 8
        critic:
          ppo_epochs: 1
        """))
    assert main(["config", "from-verl", str(verl_yaml)]) == 0
    out = capsys.readouterr().out
    recipe = yaml.safe_load(out)
    assert recipe["model"] == {"path": "/models/qwen"}  # override_config: no effect with model.path, and said so
    assert "actor_rollout_ref.model.override_config={attention_dropout: 0.0}: no effect: with model.path" in out
    assert recipe["actor"]["optim"]["lr"] == 3e-6 and recipe["actor"]["max_tokens_per_micro_batch"] == 16384
    assert recipe["rollout"]["n"] == 8 and recipe["data"]["train_files"] == [str(Path.home() / "data/train.parquet")]
    assert "critic.ppo_epochs=1: GRPO-family estimators need no critic" in out
    assert "hydra: Hydra's composition" in out and "defaults: Hydra's composition" in out


LAUNCH_SCRIPT = """\
#!/usr/bin/env bash
set -xeuo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1  # megatron's overlap
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-8B}
max_prompt_length=$((1024 * 2))
DATA=(
    data.train_files=$DATA_HOME/train.parquet  # from the environment
    data.max_prompt_length=${max_prompt_length}
)
if [ "$MODEL_PATH" = "Qwen/Qwen3-8B" ]; then
    n=8
else
    n=4
fi
python3 -m verl.trainer.main_ppo \\
    algorithm.adv_estimator=grpo \\
    "${DATA[@]}" \\
    actor_rollout_ref.model.path="$MODEL_PATH" \\
    actor_rollout_ref.rollout.n=$n \\
    "$@"
"""


def test_from_verl_reads_a_launch_script_without_running_it(tmp_path, capsys, monkeypatch):
    """`config from-verl run.sh [ARGS]`: the launch's arguments as bash would pass them (defaults,
    arithmetic, arrays, `if` on a test, the environment for names the script does not set, ARGS as
    "$@"), without running it."""
    script = tmp_path / "run_grpo.sh"
    script.write_text(LAUNCH_SCRIPT)
    monkeypatch.setenv("DATA_HOME", "/data/gsm8k")
    monkeypatch.delenv("MODEL_PATH", raising=False)
    assert main(["config", "from-verl", str(script), "trainer.total_epochs=2"]) == 0
    recipe = yaml.safe_load(capsys.readouterr().out)
    assert recipe["data"]["train_files"] == ["/data/gsm8k/train.parquet"]
    assert (recipe["data"]["max_prompt_length"], recipe["model"]["path"]) == (2048, "Qwen/Qwen3-8B")
    assert (recipe["rollout"]["n"], recipe["trainer"]["total_epochs"]) == (8, 2)
    monkeypatch.setenv("MODEL_PATH", "Qwen/Qwen3-4B")  # fills ${MODEL_PATH:-...}; the `if` takes the else
    assert main(["config", "from-verl", str(script)]) == 0
    recipe = yaml.safe_load(capsys.readouterr().out)
    assert (recipe["model"]["path"], recipe["rollout"]["n"]) == ("Qwen/Qwen3-4B", 4)
    # an override whose value names a .yaml / .sh file is an override, not a file to read
    overrides = ["actor_rollout_ref.rollout.agent.agent_loop_config_path=loops.yaml", "data.train_batch_size=4"]
    assert read_verl(overrides).items == [(overrides[0].split("=")[0], "loops.yaml"), ("data.train_batch_size", 4)]


def test_from_verl_script_refuses_what_it_cannot_read_in_one_line(tmp_path, capsys, monkeypatch):
    """A value only running the script would give (a command substitution, a variable set nowhere)
    is refused in one line naming file:line and the variable; an input with no verl key at all is
    refused, never printed as a recipe that claims nothing was dropped."""
    monkeypatch.delenv("GSM8K_DIR", raising=False)
    script = tmp_path / "run.sh"
    script.write_text("STAMP=$(date +%s)\npython3 -m verl.trainer.main_ppo \\\n"
                      "    trainer.experiment_name=grpo_$STAMP \\\n    data.train_files=$GSM8K_DIR/train.parquet\n")
    assert main(["config", "from-verl", str(script)]) == 2
    assert capsys.readouterr().err == (
        f"error: {script}:1: $STAMP cannot be known: the command substitution $(date +%s) is known only by "
        "running the script (the launch reads it at line 3)\n")
    script.write_text(script.read_text().replace("grpo_$STAMP", "grpo"))
    assert main(["config", "from-verl", str(script)]) == 2
    assert capsys.readouterr().err == (
        f"error: {script}:4: $GSM8K_DIR is set neither in the script nor in the environment\n")
    nothing = tmp_path / "setup.sh"
    nothing.write_text("pip install verl\necho ready\n")
    for argv, message in ([[str(nothing)], f"error: {nothing}: no verl launch found"],
                          [[str(tmp_path / "missing.sh")], f"error: cannot read {tmp_path / 'missing.sh'}: "],
                          [["run", "now"], "error: no verl setting in 'run now': expected verl's key=value"]):
        assert main(["config", "from-verl", *argv]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith(message) and captured.err.count("\n") == 1, captured.err
        assert "Nothing given was dropped" not in captured.out


# ---------------------------------------------------------------- verl keys given here


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.actor.optim.lr=1e-6",
     "unknown key 'actor_rollout_ref.actor.optim.lr' (override 'actor_rollout_ref.actor.optim.lr=1e-6'): "
     "verl's actor_rollout_ref.actor.optim.lr is actor.optim.lr here; `megatron-grpo config from-verl` translates "
     "a whole verl command line or YAML"),
    ("trainer.save_freq=20", "unknown key 'trainer.save_freq' (override 'trainer.save_freq=20'): verl's "
                             "trainer.save_freq is checkpoint.save_interval here (<= 0 = off (-1))"),
    ("trainer.n_gpus_per_node=8", "unknown key 'trainer.n_gpus_per_node' (override 'trainer.n_gpus_per_node=8'): "
                                  "verl's trainer.n_gpus_per_node has no equivalent here: the world size comes from "
                                  "the launcher"),
    ("trainer.logger=console", "verl's trainer.logger is logging.console / logging.wandb / logging.tensorboard here"),
    ("actor.ppo_max_token_len_per_gpu=100", "unknown key 'actor.ppo_max_token_len_per_gpu' (override "
                                            "'actor.ppo_max_token_len_per_gpu=100'): verl's actor_rollout_ref.actor."
                                            "ppo_max_token_len_per_gpu is actor.max_tokens_per_micro_batch here"),
    ("critic.ppo_epochs=2", "verl's critic.ppo_epochs has no equivalent here: GRPO-family estimators need no critic"),
])
def test_verl_key_given_here_says_what_it_is(override, message, capsys):
    assert main(["config", "show", "tiny_cpu", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown key ") and message in err and err.count("\n") == 1, err


def test_verl_section_in_a_recipe_points_to_from_verl(tmp_path, capsys):
    recipe = tmp_path / "verl_style.yaml"
    recipe.write_text("actor_rollout_ref:\n  actor:\n    optim: {lr: 1.0e-6}\n")
    assert main(["config", "show", str(recipe)]) == 2
    assert capsys.readouterr().err == (
        f"error: unknown key 'actor_rollout_ref' ({recipe}:1): 'actor_rollout_ref' is a section of verl's config; "
        "`megatron-grpo config from-verl` translates a whole verl command line or YAML (`megatron-grpo config "
        "verl-keys` lists the table)\n")
    assert hint("actor.clip_ratio_hi") is None  # our own typo still gets the spelling guess


def test_train_gets_the_hint_too(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_grpo.train", "tiny_cpu", "trainer.save_freq=5",
                           f"logging.output_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "verl's trainer.save_freq is checkpoint.save_interval here" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------- the generated table


def test_the_verl_keys_command_prints_the_table(capsys):
    """docs/verl.md holds this output (tests/test_docs.py checks it is current)."""
    assert main(["config", "verl-keys"]) == 0
    assert capsys.readouterr().out == markdown_table()


# Features this trainer has, by the words a row's note would use for them, and the key that sets each.
FEATURES_HERE = {"multi-turn": "rollout.multi_turn.environment", "tool-calling": "rollout.multi_turn.environment",
                 "kl in the reward": "algorithm.use_kl_in_reward", "dynamic sampling": "algorithm.filter_groups.enable",
                 "overlong": "reward.overlong_buffer.enable", "routing replay": "actor.moe_routing_replay",
                 "context parallel": "parallel.context", "expert parallel": "parallel.expert"}


def test_no_row_calls_a_feature_of_this_trainer_not_supported():
    """The table (and the docs made from it) once said multi-turn was not supported while
    rollout.multi_turn existed: a 'not supported' note may not name a feature listed here."""
    from megatron_grpo.config.coerce import all_keys

    keys = set(all_keys(Config))
    assert set(FEATURES_HERE.values()) <= keys  # each feature's key exists
    wrong = [(row.verl, word) for row in TABLE for word in FEATURES_HERE
             if "not supported" in row.note.lower() and word in row.note.lower()]
    assert wrong == []


def test_override_config_with_a_checkpoint_is_listed_as_no_effect():
    """verl changes a pretrained model's config by override_config(.model_config); here config.json
    is used as it is: the recipe does not carry the field, and its header says why."""
    translation = translate(parse_command_line([
        "actor_rollout_ref.model.path=Qwen/Qwen3-8B", "data.train_files=/d/train.parquet",
        "+actor_rollout_ref.model.override_config.model_config.max_position_embeddings=10240"]))
    assert not any(key.startswith("model.override_config") for key in translation.values)
    assert ("actor_rollout_ref.model.override_config.model_config.max_position_embeddings=10240: no effect: with "
            "model.path the checkpoint's config.json is used as it is" in render_recipe(translation))


def test_verls_reward_model_becomes_reward_models_rm():
    """verl 0.9's reward loop: RM enabled and no custom function = the RM's score alone; with a
    custom function verl calls only that, so nothing is scored by a model here either."""
    rm = ["reward_model.enable=true", "reward_model.model.path=Skywork/Skywork-Reward-V2-Llama-3.1-8B",
          "reward_model.rollout.name=sglang", "reward_model.rollout.tensor_model_parallel_size=2",
          "reward_model.rollout.gpu_memory_utilization=0.3", "data.train_files=/d/train.parquet"]
    values = translate(parse_command_line(rm)).values
    assert {k: v for k, v in values.items() if k.startswith(("reward.models", "reward.combine"))} == {
        "reward.models.rm.kind": "reward_model", "reward.models.rm.backend": "sglang",
        "reward.models.rm.path": "Skywork/Skywork-Reward-V2-Llama-3.1-8B", "reward.models.rm.sglang.tp_size": 2,
        "reward.models.rm.sglang.mem_fraction": 0.3, "reward.combine.weights": {"rule": 0.0, "rm": 1.0}}
    custom = translate(parse_command_line([*rm, "custom_reward_function.path=/r/score.py"]))
    assert not any(k.startswith(("reward.models", "reward.combine")) for k in custom.values)
    assert custom.values["reward.function"] == "/r/score.py:compute_score"
    assert any(e.startswith("reward_model.enable=true: no effect: with a custom reward function")
               for e in custom.changed)
