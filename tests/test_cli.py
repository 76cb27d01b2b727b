"""`megatron-grpo` CLI: config show / keys, one-line errors with exit codes, lazy subcommand dispatch."""
from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from megatron_grpo.cli import COMMANDS, Command, _dispatcher, load_command, main
from megatron_grpo.config import config_from_dict, load_config

REPO = Path(__file__).resolve().parents[1]


def test_config_show_output_loads_back_to_the_same_config(tmp_path, capsys):
    overrides = ["rollout.n=4", "actor.optim.lr=3e-6", "rollout.stop=a,b", "logging.experiment_name=12"]
    assert main(["config", "show", "tiny_cpu", *overrides]) == 0
    out = capsys.readouterr().out
    expected = load_config("tiny_cpu", overrides)
    assert config_from_dict(yaml.safe_load(out)) == expected
    shown = tmp_path / "shown.yaml"
    shown.write_text(out)
    assert main(["config", "show", str(shown)]) == 0
    assert capsys.readouterr().out == out  # showing the shown config is a fixed point


@pytest.mark.parametrize("overrides, implied", [
    ([], ["rollout.max_staleness=0: on-policy", "local engine: in the trainer's process (rank 0)",
          "weight sync route: rank0"]),
    (["rollout.max_staleness=2"], ["no sample trains more than 2 weight version(s)",
                                   "local engine: in its own process (rollout.local.process=null: by max_staleness)",
                                   "weight sync route: per_stage"]),
    (["rollout.max_staleness=1", "rollout.local.process=false", "--no-validate"],
     ["local engine: in the trainer's process (rank 0) (rollout.local.process)"]),
    (["rollout.engine=sglang", "rollout.sglang.weight_sync=tensor"], ["weight sync route: colocated"]),
])
def test_config_show_says_what_the_recipe_implies(capsys, overrides, implied):
    """What rollout.max_staleness (and the engine) change without a key of their own: where the
    local engine runs and the weight-sync route, as comments above the YAML."""
    assert main(["config", "show", "tiny_cpu", *overrides]) == 0
    comments = [line for line in capsys.readouterr().out.splitlines() if line.startswith("# implied: ")]
    for want in implied:
        assert any(want in line for line in comments), (want, comments)


def test_config_show_world_size_and_no_validate(capsys):
    assert main(["config", "show", "tiny_cpu", "--world-size", "3"]) == 2
    assert capsys.readouterr().err.startswith("error: a mini-batch of actor.ppo_mini_batch_size x rollout.n")
    assert main(["config", "show", "tiny_cpu", "rollout.n=1", "--no-validate"]) == 0
    assert load_config("tiny_cpu", ["rollout.n=1"]) == config_from_dict(yaml.safe_load(capsys.readouterr().out))


def test_config_show_check_data_runs_the_starts_data_checks_without_a_model(tmp_path, capsys):
    """--check-data: the model's context (config.json), the tokenizer and every prompt file, each
    problem as one line with exit 2, and nothing written (no initial_model/, no output folder)."""
    import json

    from megatron_grpo.data.synthetic import build_tokenizer
    from megatron_grpo.models.tiny import save_tiny_hf_model

    out = tmp_path / "run"
    assert main(["config", "show", "tiny_cpu", f"logging.output_dir={out}", "--check-data"]) == 0
    shown = capsys.readouterr().out
    assert "# data: train: 4096 prompts" in shown and "# data: eval: 128 prompts" in shown
    model = save_tiny_hf_model("qwen3", tmp_path / "model", max_position_embeddings=64)
    build_tokenizer(model)
    row = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1 + 1"}],
           "reward_model": {"ground_truth": "2"}}
    data = tmp_path / "train.jsonl"
    latin1 = json.dumps(row, ensure_ascii=False).replace("1 + 1", "caf\u00e9").encode("latin-1")  # é = 0xe9
    data.write_bytes(json.dumps(row).encode() + b"\n" + latin1 + b"\n")
    base = ["config", "show", "--check-data", "tiny_cpu", f"model.path={model}", "data.task=null",
            f"data.train_files={data}", "eval.interval=-1", f"logging.output_dir={out}"]
    assert main([*base, "data.max_response_length=64"]) == 2
    assert f"exceed the model's context of 64 (max_position_embeddings in {model}/config.json)" in \
        capsys.readouterr().err
    # a multi-turn trajectory (the prompt, every turn and observation) is one sequence too
    assert main([*base, "rollout.multi_turn.environment=lookup", "rollout.multi_turn.max_length=65"]) == 2
    assert capsys.readouterr().err == (
        "error: rollout.multi_turn.max_length=65 tokens (the prompt and every turn) exceed the model's context of "
        f"64 (max_position_embeddings in {model}/config.json)\n")
    assert main(base) == 2
    error = capsys.readouterr().err
    assert f"{data}:2" in error and error.count("\n") == 1
    assert not out.exists()


def test_config_error_is_one_line_with_exit_code_2(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("actor:\n  clip_ratio_hi: 0.28\n")
    assert main(["config", "show", str(recipe)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"error: unknown key 'actor.clip_ratio_hi' ({recipe}:2); "
                            "did you mean 'actor.clip_ratio_high'?\n")


def test_config_keys_lists_every_leaf_with_its_default(capsys):
    assert main(["config", "keys"]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    table = {key: (kind, default) for key, kind, default in rows}
    assert table["actor.clip_ratio_c"] == ("float", "3.0")
    assert table["actor.kl_loss_type"][1] == '"low_var_kl"'
    assert table["trainer.total_steps"] == ("int or null", "null")
    assert table["actor.optim.betas"] == ("a list of float", "[0.9, 0.999]")
    assert len(rows) == len(set(table))


def test_subcommands_are_registered_lazily():
    assert set(COMMANDS) == {"train", "eval", "convert", "export", "doctor", "plan"}
    assert COMMANDS["train"].target == "megatron_grpo.trainer.main:main"
    with pytest.raises(TypeError):
        COMMANDS["x"] = Command("a:b", "")  # type: ignore[index]  # the table is read-only


def test_every_subcommand_target_is_a_function():
    for name, command in COMMANDS.items():
        assert callable(load_command(name, command)), command.target


def test_dispatch_passes_argv_and_import_errors_inside_a_module_propagate(tmp_path, monkeypatch):
    (tmp_path / "fake_cmd.py").write_text(textwrap.dedent("""
        def main(argv):
            return 7 if argv == ["RECIPE", "a.b=1", "--flag"] else 1
        """))
    (tmp_path / "broken_cmd.py").write_text("import no_such_dependency_xyz\ndef main(argv):\n    return 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run = _dispatcher("train", Command("fake_cmd:main", ""))
    assert run(argparse.Namespace(argv=["RECIPE", "a.b=1", "--flag"])) == 7
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
        load_command("train", Command("broken_cmd:main", ""))


def test_cli_process_exit_code_one_line_and_no_heavy_imports(tmp_path):
    """One real process: the config path imports neither torch nor megatron, and a config error
    exits 2 with exactly one stderr line, no traceback."""
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("rollout:\n  n: two\n")
    code = ("import sys; from megatron_grpo.cli import main; rc = main(sys.argv[1:]); "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')); "
            "print(heavy, file=sys.stdout); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, "config", "show", str(recipe)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"error: rollout.n: expected int, got 'two' (str) ({recipe}:2)\n"
    assert proc.stdout.strip() == "[]"


def test_console_script_entry_point(tmp_path):
    script = Path(sys.executable).with_name("megatron-grpo")
    if not script.exists():
        pytest.skip("the package is not installed in this interpreter's environment")
    proc = subprocess.run([str(script), "config", "show", "tiny_cpu", "rollout.n=1"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: algorithm.adv_estimator=grpo needs rollout.n >= 2")
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


# Each flag's bad values, with the one line that refuses them. The recipe / checkpoint named is missing:
# had anything been read before the flags were checked, the error would name it instead.
BAD_FLAGS = [
    (["config", "show", "no_such_recipe"], [("--world-size", "0", "must be a positive integer, got 0"),
                                            ("--ranks-per-node", "-2", "must be a positive integer, got -2")]),
    (["plan", "no_such_recipe"], [("--nodes", "0", "must be a positive integer, got 0"),
                                  ("--nodes", "1.5", "must be a positive integer, got 1.5"),
                                  ("--gpus-per-node", "-8", "must be a positive integer, got -8"),
                                  ("--trainer-gpus", "0", "must be a positive integer, got 0"),
                                  ("--gpu-memory-gb", "nan", "must be a positive number, got nan"),
                                  ("--gpu-memory-gb", "0", "must be a positive number, got 0"),
                                  ("--link-gbps", "inf", "must be a positive number, got inf"),
                                  ("--reserve-gb", "-1", "must be a number >= 0, got -1"),
                                  ("--reserve-gb", "80", "80 must be less than --gpu-memory-gb 80"),
                                  ("--json", "{tmp}/missing/plan.json", "its folder {tmp}/missing does not exist"),
                                  ("--json", "{tmp}", "{tmp} is a folder, not a file")]),
    (["doctor", "no_such_recipe"], [("--world-size", "0", "must be a positive integer, got 0"),
                                    ("--ranks-per-node", "-1", "must be a positive integer, got -1"),
                                    ("--port", "0", "must be a port number (1 to 65535), got 0"),
                                    ("--port", "70000", "must be a port number (1 to 65535), got 70000")]),
    (["export", "no_such_run", "--out", "{tmp}/hf"], [("--step", "0", "must be a positive integer, got 0"),
                                                      ("--tp", "0", "must be a positive integer, got 0"),
                                                      ("--pp", "-2", "must be a positive integer, got -2"),
                                                      ("--ep", "0", "must be a positive integer, got 0"),
                                                      ("--etp", "0", "must be a positive integer, got 0"),
                                                      ("--max-shard-size", "0GB", "must be a size such as 5GB"),
                                                      ("--max-shard-size", "infGB", "must be a size such as 5GB"),
                                                      ("--max-shard-size", "big", "must be a size such as 5GB")]),
    (["convert", "megatron-to-hf", "--ckpt", "no_such_ckpt"],
     [("--out", "{tmp}/file/hf", "its folder {tmp}/file is not a folder")]),
    (["convert", "hf-to-megatron", "--hf", "no_such_model", "--out", "{tmp}/mc"],
     [("--vocab-multiple", "0", "must be a positive integer, got 0"), ("--tp", "-1", "must be a positive integer")]),
]


@pytest.mark.parametrize("command, flag, value, message",
                         [(command, *case) for command, cases in BAD_FLAGS for case in cases],
                         ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_bad_flags_are_refused_in_one_line_before_anything_is_read(tmp_path, capsys, command, flag, value, message):
    """0, negative, nan, inf, a reserve above the memory, an output whose folder is missing or a file:
    `error: --flag ...`, exit 2, checked while the arguments are parsed (no recipe read, no plan
    simulated, no checkpoint opened)."""
    (tmp_path / "file").write_text("")
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in [*command, flag, value]]
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith(f"error: {flag} ") and err.count("\n") == 1, err
    assert message.replace("{tmp}", str(tmp_path)) in err, err


def test_show_requires_a_recipe(capsys):
    with pytest.raises(SystemExit) as info:
        main(["config", "show"])
    assert info.value.code == 2  # argparse's usage error
    assert "the following arguments are required: recipe" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["train"], ["eval"], ["convert"], ["export"], ["doctor"], ["plan"], ["config"],
                                     ["config", "show"], ["config", "keys"], ["config", "from-verl"],
                                     ["config", "verl-keys"]])
def test_help_on_every_subcommand(command, capsys):
    """`--help` reaches the subcommand's own parser (it used to be refused as an unknown argument)."""
    for flag in ("--help", "-h"):
        with pytest.raises(SystemExit) as info:
            main([*command, flag])
        assert info.value.code == 0
        captured = capsys.readouterr()
        assert captured.out.startswith(f"usage: megatron-grpo {' '.join(command)}"), captured
        assert captured.err == ""


def test_every_registered_subcommand_has_a_help_test():
    """A subcommand added to COMMANDS joins the --help test above."""
    tested = {c[0] for c in test_help_on_every_subcommand.pytestmark[0].args[1]}
    assert set(COMMANDS) <= tested
