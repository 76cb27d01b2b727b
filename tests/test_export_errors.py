"""Bad input to `export` / `convert`: one `error:` line on stderr naming the path or option,
never a traceback. Run through the real CLI in a fresh process, as a user meets them."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_grpo.models.tiny import save_tiny_hf_model
from megatron_grpo.testing.distributed import run_distributed

REPO = Path(__file__).resolve().parents[1]


def megatron_grpo(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_grpo.cli", *argv], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def one_error_line(result: subprocess.CompletedProcess, code: int, *names: str) -> str:
    """Asserts the process failed with `code` and printed exactly one line, `error: ...`, that
    contains every one of `names`; returns it."""
    lines = result.stderr.splitlines()
    assert result.returncode == code, (result.returncode, result.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def _convert(rank, world_size, argv):
    from megatron_grpo.convert.cli import main

    return main(argv)


@pytest.fixture(scope="module")
def convert_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    src = save_tiny_hf_model("qwen2", root / "hf", seed=2)
    assert run_distributed(_convert, 1, (["hf-to-megatron", "--hf", str(src), "--out", str(root / "mc")],))[0] == 0
    return root / "mc"


def test_truncated_distcp_shard_is_one_line(convert_checkpoint, tmp_path):
    import shutil

    ckpt = tmp_path / "mc"
    shutil.copytree(convert_checkpoint, ckpt)
    shard = max((ckpt / "model").glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a copy cut short
    result = megatron_grpo("convert", "megatron-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "out"))
    line = one_error_line(result, 1, str(shard))
    assert "truncated" in line and not (tmp_path / "out").exists()


def test_layers_not_divisible_by_pp_is_one_line(tmp_path):
    src = save_tiny_hf_model("qwen2", tmp_path / "hf3", seed=1, num_hidden_layers=3)
    result = megatron_grpo("convert", "hf-to-megatron", "--hf", str(src), "--out", str(tmp_path / "mc"), "--pp", "2")
    line = one_error_line(result, 2, "--pp 2", str(src / "config.json"))
    assert "3 layers" in line and not (tmp_path / "mc").exists()


def test_export_of_a_folder_that_is_no_checkpoint_is_one_line(tmp_path):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "readme.txt").write_text("not a checkpoint\n")
    result = megatron_grpo("export", str(folder), "--out", str(tmp_path / "out"))
    line = one_error_line(result, 1, str(folder))
    assert "not a checkpoint" in line and "run folder" in line


def test_other_bad_export_paths_name_what_is_wrong(convert_checkpoint, tmp_path, capsys):
    """The same one-line errors, in-process (cheap): each case names the path and what is wrong."""
    from megatron_grpo.convert.export_cli import main

    run = tmp_path / "run"
    (run / "checkpoints" / "step_3" / "model_optim").mkdir(parents=True)  # a save that never finished
    cases = [
        ([str(tmp_path / "missing")], f"{tmp_path / 'missing'}: no such file or folder"),
        ([str(run)], f"{run / 'checkpoints'}: no complete checkpoint (step_3: no complete.json"),
        ([str(run), "--step", "7"], f"{run / 'checkpoints'}: no step_7 (found step_3)"),
        ([str(convert_checkpoint), "--step", "2"], "--step 2 applies to training checkpoints"),
        ([str(convert_checkpoint), "--pp", "3"], "--pp 3:"),
    ]  # (a bad flag alone, --max-shard-size big: tests/test_cli.py, refused before anything is read)
    for argv, expected in cases:
        code = main([*argv, "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert code in (1, 2) and err.startswith("error: ") and err.count("\n") == 1, (argv, err)
        assert expected in err, (argv, err)


def test_export_refuses_an_output_over_what_it_reads_even_with_force(tmp_path, capsys):
    """`export RUN --out RUN/checkpoints/step_40 --force` once replaced the checkpoint it read with
    the HF folder and exited 0: an --out that is, lies inside or holds the source (the checkpoint,
    its checkpoints folder, its run folder, --hf-reference) is one line naming both, exit 2, and
    nothing is touched."""
    from megatron_grpo.convert.export_cli import main

    run = tmp_path / "run"
    step = run / "checkpoints" / "step_40"
    (step / "model_optim").mkdir(parents=True)
    (step / "complete.json").write_text("{}")
    cases = [
        ([str(run), "--out", str(step)], f"--out {step} lies inside the source {run},"),
        ([str(step), "--out", str(step)], f"--out {step} is the source {step},"),
        ([str(step / "model_optim"), "--out", str(run)], f"--out {run} holds the source {step / 'model_optim'},"),
        ([str(step), "--out", str(run / "hf")], f"--out {run / 'hf'} lies inside the run folder {run},"),
        ([str(step), "--out", str(run / "checkpoints" / "step_35")],
         f"lies inside the checkpoints folder {run / 'checkpoints'},"),
        ([str(run), "--out", str(tmp_path / "base"), "--hf-reference", str(tmp_path / "base")],
         f"--out {tmp_path / 'base'} is --hf-reference {tmp_path / 'base'},"),
    ]
    for argv, expected in cases:
        code = main([*argv, "--force"])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (argv, err)
        assert expected in err and "even with --force" in err, (argv, err)
    assert sorted(p.name for p in step.iterdir()) == ["complete.json", "model_optim"]
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]
