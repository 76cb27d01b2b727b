"""A verl user's files, unchanged: verl's GRPO command line (through `config from-verl`) and a verl
reward file train the tiny task; a reward function that fails on every call stops the run with
one error instead of training on reward 0."""
from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# verl's documented custom reward function (docs/preparation/reward_function.rst), verbatim
VERL_REWARD_FILE = """\
def my_reward_fn(data_source, solution_str, ground_truth, extra_info=None):
  return len(solution_str)/100
"""

# verl's GRPO example (examples/grpo_trainer/run_qwen3-8b.sh) shrunk to the tiny task: its sizes,
# the tiny model and data, the reward file above; every key is verl's.
VERL_COMMAND = """python3 -m verl.trainer.main_ppo \\
    algorithm.adv_estimator=grpo \\
    data.train_files={data}/train.parquet \\
    data.val_files={data}/test.parquet \\
    data.train_batch_size=8 \\
    data.max_prompt_length=32 \\
    data.max_response_length=8 \\
    data.filter_overlong_prompts=True \\
    data.truncation='error' \\
    actor_rollout_ref.model.path={model} \\
    actor_rollout_ref.actor.optim.lr=1.5e-3 \\
    actor_rollout_ref.model.use_remove_padding=True \\
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \\
    actor_rollout_ref.actor.use_dynamic_bsz=True \\
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096 \\
    actor_rollout_ref.actor.use_kl_loss=True \\
    actor_rollout_ref.actor.kl_loss_coef=0.001 \\
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \\
    actor_rollout_ref.actor.entropy_coeff=0 \\
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \\
    actor_rollout_ref.rollout.name=vllm \\
    actor_rollout_ref.rollout.n=4 \\
    algorithm.use_kl_in_reward=False \\
    custom_reward_function.path={data}/my_reward.py \\
    custom_reward_function.name=my_reward_fn \\
    reward.num_workers=1 \\
    trainer.logger='["console"]' \\
    trainer.project_name='verl_grpo_tiny' \\
    trainer.experiment_name='tiny_reverse' \\
    trainer.n_gpus_per_node=1 \\
    trainer.nnodes=1 \\
    trainer.save_freq=-1 \\
    trainer.test_freq=-1 \\
    trainer.total_training_steps=3"""

# What the CPU run adds on our side: the in-process engine (no vLLM / SGLang here) on the CPU.
OUR_OVERRIDES = ["rollout.engine=local", "trainer.device=cpu", "logging.plot=false"]


def _tiny_task_files(folder: Path) -> tuple[Path, Path]:
    """recipes/tiny_cpu.yaml's task and model as verl files: parquet data in verl's layout and an
    HF model folder (random init, the synthetic tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    from megatron_grpo.data.synthetic import SyntheticTaskConfig, build_tokenizer, write_dataset

    task = SyntheticTaskConfig(task="reverse", min_digits=3, max_digits=3, num_symbols=4)
    data = folder / "data"
    write_dataset(task, data / "train.parquet", count=64, seed=0)
    write_dataset(task, data / "test.parquet", count=8, seed=1, split="test")
    (data / "my_reward.py").write_text(VERL_REWARD_FILE)
    model = folder / "model"
    tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(folder / "tokenizer"))
    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=True,
                         vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model)
    tokenizer.save_pretrained(model)
    return data, model


def _cli(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    # this checkout's package, whatever the working folder (an installed copy may be elsewhere)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "megatron_grpo.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_verl_command_line_and_reward_file_train_the_tiny_task(tmp_path):
    data, model = _tiny_task_files(tmp_path)
    line = VERL_COMMAND.format(data=data, model=model)
    translated = _cli("config", "from-verl", *shlex.split(line.replace("\\\n", " ")), cwd=tmp_path)
    assert translated.returncode == 0, translated.stderr
    recipe = tmp_path / "from_verl.yaml"
    recipe.write_text(translated.stdout)
    assert f"function: {data}/my_reward.py:my_reward_fn" in translated.stdout
    out = tmp_path / "run"
    proc = _cli("train", str(recipe), *OUR_OVERRIDES, f"logging.output_dir={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    from megatron_grpo.data.synthetic import vocabulary

    longest = 8 * max(len(token) for token in vocabulary())  # characters in 8 decoded tokens, at most
    for record in steps:
        # verl's function got solution_str (the decoded response): len / 100
        assert math.isfinite(record["reward/mean"]) and 0 < record["reward/mean"] <= longest / 100
        assert record["reward/errors"] == 0.0 and math.isfinite(record["actor/kl_loss"])
    # verl validates before training by default (trainer.val_before_train): so did the translated run
    assert records[0]["step"] == 0 and math.isfinite(records[0]["eval/reward_mean"])


FAILING_VERL_REWARD = """\
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "openai/gsm8k":
        return float(solution_str.strip().endswith(ground_truth))
    raise NotImplementedError(f"Reward function is not implemented for {data_source=}")
"""


@pytest.mark.slow
def test_reward_failing_on_every_call_stops_the_run_with_one_error(tmp_path):
    """The synthetic task's rows are not gsm8k: the function raises on every call. The run stops
    at step 1 (exit 1) with one line naming the function, the input and the exception."""
    reward = tmp_path / "verl_reward.py"
    reward.write_text(FAILING_VERL_REWARD)
    out = tmp_path / "run"
    proc = _cli("train", "tiny_cpu", f"reward.function={reward}:compute_score", "trainer.total_steps=3",
                "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4", "logging.console=false",
                "logging.plot=false", f"logging.output_dir={out}", cwd=REPO)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [errors[0]] and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: reward function {reward}:compute_score failed on 32 of 32 calls "
                                "(raised 32), more than reward.max_error_frac=0.5; first failure (raised) on "
                                "data_source='synthetic/digits'")
    assert errors[0].endswith("NotImplementedError: Reward function is not implemented for "
                              "data_source='synthetic/digits'")
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip()
