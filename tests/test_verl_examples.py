"""verl's own launch scripts (tests/data/verl_examples, SOURCE.md: every examples/grpo_trainer/*.sh
of verl at a pinned commit and the DAPO recipe's scripts, as the arguments bash evaluated) through
`config from-verl`: each translates; every key it sets is either translated or listed in the
recipe's header with its reason; a key verl passes through unchanged keeps its value; and the
recipe validates at the script's own world size (trainer.nnodes x trainer.n_gpus_per_node), or is
refused for a reason named here, in one line that names the key. The scripts themselves (NAME.sh
beside NAME.args), read by `config from-verl` without running them, give the arguments bash gave."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_grpo.config import validate
from megatron_grpo.config.from_verl import config_of, parse_command_line, read_script, render_recipe, translate
from megatron_grpo.config.verl_keys import lookup
from megatron_grpo.errors import ConfigError

DATA = Path(__file__).parent / "data" / "verl_examples"
SCRIPTS = sorted(DATA.glob("*/*.args"))

# What the trainer refuses in verl's scripts, and why (the message must say so).
REFUSED = {
    # the scripts read variables they never set: $gsm8k_train_path, $aime24_test_path
    "grpo_trainer/run_gptoss_20b": "data.train_files: entry 0 is an empty path",
    "grpo_trainer/run_qwen3moe-30b_megatron_96gb": "data.val_files: entry 0 is an empty path",
    # one SGLang engine over several nodes (rollout TP 16 / 32): engines here span one node's GPUs
    "grpo_trainer/run_deepseek671b_math_megatron_80gb": "does not divide the 8 trainer GPUs of a node",
    "grpo_trainer/run_deepseek671b_math_megatron_96gb": "does not divide the 8 trainer GPUs of a node",
    "grpo_trainer/run_qwen3_vl-235b-megatron": "does not divide the 8 trainer GPUs of a node",
    "dapo/test_dapo_dspk_671b_megatron_96gb": "does not divide the 8 trainer GPUs of a node",
    "dapo/test_dapo_qwen3next_80b_megatron": "does not divide the 8 trainer GPUs of a node",
    # verl's Ulysses SP 2 makes its data-parallel size 16; without it here the 32 GPUs are DP 32,
    # which a mini-batch of 16 sequences cannot be split over (parallel.context=2 would)
    "dapo/run_dapo_qwen3_14b_base_npu": "is not divisible by the data-parallel size 32",
    # a checkpoint's own Python code (custom tokenizer / model classes) is not run here yet
    "grpo_trainer/run_minicpmo2_6": "model.trust_remote_code=True",
    "grpo_trainer/run_moonlight16b_math_megatron": "model.trust_remote_code=True",
    # verl's reward model runs on the trainer's own workers; here it is served by SGLang servers the
    # translation cannot invent (its header and this line name the key to give)
    "grpo_trainer/run_mistral13b_skyworkrm_hhrlhf": "reward.models.rm.sglang: give the servers' urls, or the gpus",
    # fp16 training would need loss scaling; bfloat16 is the supported half precision
    "dapo/test_dapo_8b_megatron_fp16": "model.dtype=float16 is not supported",
    "dapo/test_dapo_qwen3_moe_30b_megatron_fp16": "model.dtype=float16 is not supported",
}


# The environment extract.sh ran the scripts in ($PWD: the folder it ran them from)
EXTRACT_ENVIRONMENT = {"HOME": "/home/user", "RAY_DATA_HOME": "/home/user/verl", "PWD": "/tmp/tmp.m5FR89g88f"}
# Variables scripts read but never set (bash passes them empty): the reader refuses each, naming it,
# until the environment sets it (here: empty, as bash had them)
NEVER_SET = {
    "grpo_trainer/run_deepseek671b_math_megatron_80gb": ["CKPT_DIR"],
    "grpo_trainer/run_gptoss_20b": ["gsm8k_train_path", "gsm8k_test_path"],
    "grpo_trainer/run_moonlight16b_math_megatron": ["DIST_CKPT_PATH"],
    "grpo_trainer/run_qwen2-7b_math_trtllm": ["EXP_NAME_SUFFIX"],
    "grpo_trainer/run_qwen2_5_vl-7b-megatron": ["DIST_CKPT_PATH"],
    "grpo_trainer/run_qwen3_8b_grpo_sglang_1k_spmd_npu": ["pwd"],  # (meant $PWD)
    "grpo_trainer/run_qwen3_8b_grpo_sglang_32k_spmd_npu": ["pwd"],
    "grpo_trainer/run_qwen3moe-30b_megatron_96gb": ["aime24_test_path"],
}


def _name(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


def test_the_data_holds_every_script_of_the_pinned_commits():
    names = [_name(p) for p in SCRIPTS]
    assert sum(n.startswith("grpo_trainer/") for n in names) == 50 and sum(n.startswith("dapo/") for n in names) == 24
    assert all(p.read_text().strip() for p in SCRIPTS), "a script whose launch was not found"
    assert set(REFUSED) <= set(names)


def _world(given: dict) -> tuple[int, int]:
    per_node = int(given.get("trainer.n_gpus_per_node", 8))
    return int(given.get("trainer.nnodes", 1)) * per_node, per_node


@pytest.mark.parametrize("path", SCRIPTS, ids=_name)
def test_verl_example_translates_keeps_its_values_and_validates(path):
    parsed = parse_command_line(path.read_text().splitlines())
    given = dict(parsed.items)
    translation = translate(parsed)
    header = render_recipe(translation).split("\n" + "model:")[0]
    for key, value in given.items():
        row = lookup(key)
        translated = (row is not None and bool(row.ours or row.convert) and "${" not in str(value)
                      and bool(row.translate(value, given, key).values))
        assert translated or f"{key}=" in header, f"{key} is neither translated nor listed with its reason"
        if translated and row is not None and row.convert is None and row.ours:
            ours = row.ours[0]
            if translation.origin.get(ours) == f"from verl's {key}" and not isinstance(value, str):
                assert translation.values[ours] == value, (key, ours)
    world, per_node = _world(given)
    config = _as_launched(config_of(translation), world, per_node)
    name = _name(path)
    if name in REFUSED:
        with pytest.raises(ConfigError) as error:
            validate(config, world_size=world, ranks_per_node=per_node)
        assert REFUSED[name] in str(error.value) and "\n" not in str(error.value).strip()
    else:
        validate(config, world_size=world, ranks_per_node=per_node)


def _as_launched(config, world: int, per_node: int):
    """On several nodes the SGLang engines are started by slurm/ on every node and given to the
    trainer by URL (the trainer launches engines on rank 0's node only): the test validates the
    recipe with the URLs slurm/grpo_*.sh would add."""
    import dataclasses

    s = config.rollout.sglang
    if config.rollout.engine != "sglang" or world <= per_node or s.urls:
        return config
    urls = [f"http://node{k}:30000" for k in range(s.num_engines)]
    return dataclasses.replace(config, rollout=dataclasses.replace(
        config.rollout, sglang=dataclasses.replace(s, urls=urls)))


@pytest.mark.parametrize("path", SCRIPTS, ids=_name)
def test_verl_script_read_without_running_it_gives_what_bash_passed(path):
    """`config from-verl NAME.sh`: the script's launch arguments, from its assignments, ${X:-default},
    $((...)), arrays, "$@" and `if` tests, equal what bash passed (NAME.args); a variable the script
    reads but never sets is refused in one line naming file:line and the variable, until the
    environment sets it."""
    script = path.with_suffix(".sh")
    environment = dict(EXTRACT_ENVIRONMENT)
    for variable in NEVER_SET.get(_name(path), []):
        with pytest.raises(ConfigError) as error:
            read_script(script, environ=environment)
        message = str(error.value)
        assert f"${variable} is set neither in the script nor in the environment" in message, message
        where, line = message.split(":")[:2]
        assert where == str(script) and "\n" not in message
        assert variable in script.read_text().splitlines()[int(line) - 1]  # the line that reads it
        environment[variable] = ""
    bash = parse_command_line(path.read_text().splitlines())
    read = read_script(script, environ=environment)
    assert read.items == bash.items
    # besides bash's Hydra flags, the header lists what was not read: `source FILE` (an Ascend / env.sh setup)
    assert read.ignored[:len(bash.ignored)] == bash.ignored
    assert all("`source " in note and note.endswith("(may set variables; not read)")
               for note in read.ignored[len(bash.ignored):])
