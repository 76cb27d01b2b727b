"""convert/: HF -> Megatron -> HF round trips (bitwise), streaming export vs the tool's output,
layout independence of checkpoints, and the errors for bad inputs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_grpo.convert.hf_io import HFCheckpoint
from megatron_grpo.convert.mappings import expected_hf_tensors
from megatron_grpo.errors import CheckpointError, ConfigError
from megatron_grpo.models.hf_config import ModelArchitecture
from megatron_grpo.models.tiny import save_tiny_hf_model
from megatron_grpo.testing.distributed import run_distributed

ARCHS = ("qwen2", "qwen3", "llama")
REPO = Path(__file__).resolve().parents[1]


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def assert_same_tensors(a: dict, b: dict, what: str):
    assert sorted(a) == sorted(b), f"{what}: names differ: {sorted(set(a) ^ set(b))}"
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), f"{what}: {name} differs"


def _cli(rank, world_size, argv):
    from megatron_grpo.convert.cli import main

    return main(argv)


def cli(argv, world_size=1):
    """Runs the convert CLI in world_size gloo processes (torchrun-like) and returns rank 0's code."""
    return run_distributed(_cli, world_size=world_size, args=(argv,), timeout=300)[0]


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    models = {}
    for i, arch in enumerate(ARCHS):
        path = save_tiny_hf_model(arch, root / arch, seed=10 + i)
        (path / "tokenizer_config.json").write_text('{"model_max_length": 256}\n')
        models[arch] = path
    return models


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_hf_megatron_hf_roundtrip_is_bitwise(hf_models, tmp_path, arch):
    src = hf_models[arch]
    assert cli(["hf-to-megatron", "--hf", str(src), "--out", str(tmp_path / "mc"), "--tp", "2"]) == 0
    stored = json.loads((tmp_path / "mc" / "megatron_grpo_model.json").read_text())
    assert stored["padded_vocab_size"] == 256
    # llama (untied lm_head) is exported from a TP=2, PP=2 load under 4 ranks; the others in one process.
    layout = ["--tp", "2", "--pp", "2"] if arch == "llama" else []
    assert cli(["megatron-to-hf", "--ckpt", str(tmp_path / "mc"), "--out", str(tmp_path / "back"),
                "--max-shard-size", "60KB", *layout], world_size=4 if layout else 1) == 0
    back = tmp_path / "back"
    assert_same_tensors(hf_tensors(src), hf_tensors(back), arch)
    assert (back / "config.json").read_bytes() == (src / "config.json").read_bytes()
    for asset in ("generation_config.json", "tokenizer_config.json"):
        assert (back / asset).read_bytes() == (src / asset).read_bytes()
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded output, transformers naming
    assert set(index["weight_map"]) == set(hf_tensors(src))
    # transformers itself loads the exported folder.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(back), dtype=torch.float32)
    assert model.config.model_type == arch


def _save_at_layout(rank, world_size, src, out, tp, pp):
    from megatron_grpo.convert import load_hf_weights, save_megatron_checkpoint
    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import build_model

    layout = ParallelLayout(tensor=tp, pipeline=pp)
    initialize_model_parallel(layout)
    cfg = ModelArchitecture.from_hf(src, tensor_parallel=tp)
    chunks = build_model(cfg, layout)
    load_hf_weights(chunks, cfg, src)
    save_megatron_checkpoint(chunks, cfg, out, assets_from=src)


def _stream_exports(rank, world_size, src, tp, pp):
    from megatron_grpo.convert import export_hf_weights, gather_hf_weights_on_rank0, load_hf_weights
    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import build_model

    layout = ParallelLayout(tensor=tp, pipeline=pp)
    initialize_model_parallel(layout)
    cfg = ModelArchitecture.from_hf(src, tensor_parallel=tp)
    chunks = build_model(cfg, layout)
    load_hf_weights(chunks, cfg, src)
    per_stage = {name: t.clone() for name, t in export_hf_weights(chunks, cfg)}
    on_rank0 = {name: t.clone() for name, t in gather_hf_weights_on_rank0(chunks, cfg)}
    return per_stage, on_rank0


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3"])  # tied: the last stage's output copy is not exported
def test_layouts_export_the_same_hf_files(hf_models, tmp_path, arch):
    src = hf_models[arch]
    # A checkpoint saved at TP=2, PP=2 and one saved at TP=1 convert to the same HF files.
    run_distributed(_save_at_layout, 4, args=(str(src), str(tmp_path / "tp2pp2"), 2, 2), timeout=300)
    run_distributed(_save_at_layout, 1, args=(str(src), str(tmp_path / "tp1"), 1, 1), timeout=300)
    assert cli(["megatron-to-hf", "--ckpt", str(tmp_path / "tp2pp2"), "--out", str(tmp_path / "a")]) == 0
    assert cli(["megatron-to-hf", "--ckpt", str(tmp_path / "tp1"), "--out", str(tmp_path / "b"),
                "--tp", "2", "--pp", "2"], world_size=4) == 0  # and loading it at TP=2, PP=2
    files_a = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files_a == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in files_a:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert_same_tensors(hf_tensors(src), hf_tensors(tmp_path / "a"), arch)

    # The streaming export (per stage, and collected on rank 0) equals the tool's output bitwise.
    results = run_distributed(_stream_exports, 4, args=(str(src), 2, 2), timeout=300)
    tool = hf_tensors(tmp_path / "a")
    assert_same_tensors(tool, results[0][1], "gathered on rank 0")
    assert all(not r[1] for r in results[1:])  # yields on global rank 0 only
    stage0, stage1 = results[0][0], results[2][0]  # ranks 0,1: stage 0; ranks 2,3: stage 1
    assert_same_tensors(results[0][0], results[1][0], "TP ranks of stage 0")
    assert not set(stage0) & set(stage1)
    assert_same_tensors(tool, {**stage0, **stage1}, "per-stage exports")
    assert "model.layers.3.mlp.down_proj.weight" in stage1 and "model.embed_tokens.weight" in stage0


# ---- bad inputs ------------------------------------------------------------------------------

@pytest.fixture()
def sharded_qwen2(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_tiny_hf_model("qwen2", tmp_path / "one", seed=3)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="100KB")
    return tmp_path / "sharded"


def _validate(folder: Path):
    cfg = ModelArchitecture.from_hf(folder)
    with HFCheckpoint(folder) as ckpt:
        ckpt.validate(expected_hf_tensors(cfg))


def test_valid_sharded_folder_passes(sharded_qwen2):
    assert len(list(sharded_qwen2.glob("*.safetensors"))) > 1
    _validate(sharded_qwen2)


def test_wrong_architecture(sharded_qwen2):
    config = json.loads((sharded_qwen2 / "config.json").read_text())
    (sharded_qwen2 / "config.json").write_text(json.dumps(dict(config, model_type="gpt2")))
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported; supported: deepseek_v3, glm4_moe, "
                                          "llama, qwen2, qwen2_moe, qwen3"):
        _validate(sharded_qwen2)


def test_shape_mismatch(sharded_qwen2):
    config = json.loads((sharded_qwen2 / "config.json").read_text())
    (sharded_qwen2 / "config.json").write_text(json.dumps(dict(config, intermediate_size=96)))
    with pytest.raises(CheckpointError, match=r"shapes do not match.*mlp.down_proj.weight: file \(64, 128\) "
                                              r"vs config \(64, 96\)"):
        _validate(sharded_qwen2)


def test_missing_shard_file(sharded_qwen2):
    victim = sorted(sharded_qwen2.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"shard file\\(s\\) missing .*{victim.name}"):
        _validate(sharded_qwen2)


def test_truncated_safetensors(sharded_qwen2):
    victim = sorted(sharded_qwen2.glob("*.safetensors"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=f"{victim.name}.*truncated"):
        _validate(sharded_qwen2)


def test_missing_and_unexpected_tensors(sharded_qwen2):
    victim = sorted(sharded_qwen2.glob("*.safetensors"))[0]
    tensors = load_file(str(victim))
    dropped = sorted(tensors)[0]
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    del tensors[dropped]
    save_file(tensors, str(victim), metadata={"format": "pt"})
    index_path = sharded_qwen2 / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.0.self_attn.o_proj.bias"] = victim.name
    del index["weight_map"][dropped]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"missing \\[{dropped}\\]; unexpected "
                                              r"\[model.layers.0.self_attn.o_proj.bias\]"):
        _validate(sharded_qwen2)


def test_no_safetensors(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="only safetensors are supported"):
        HFCheckpoint(tmp_path)


def test_cli_help_and_refusals(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "tools" / "convert_hf_to_megatron.py"), "--help"],
                         capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert "examples:" in out and "--force" in out and "torchrun" in out
    source = tmp_path / "source"
    source.mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    from megatron_grpo.convert.cli import main

    # a non-empty --out without --force, then a folder that is not a checkpoint
    assert main(["hf-to-megatron", "--hf", str(source), "--out", str(tmp_path / "out")]) == 1
    assert main(["megatron-to-hf", "--ckpt", str(source), "--out", str(tmp_path / "new")]) == 1


@pytest.mark.slow
def test_checkpoint_config_must_match_reference(hf_models, tmp_path):
    assert cli(["hf-to-megatron", "--hf", str(hf_models["qwen2"]), "--out", str(tmp_path / "mc")]) == 0
    argv = ["megatron-to-hf", "--ckpt", str(tmp_path / "mc"), "--out", str(tmp_path / "x"),
            "--hf-reference", str(hf_models["llama"])]
    from megatron_grpo.convert.cli import main

    with pytest.raises(CheckpointError, match="does not match the model config"):
        from megatron_grpo.convert.loader import check_hf_config_matches

        check_hf_config_matches(ModelArchitecture.load(tmp_path / "mc"), hf_models["llama"])
    assert main(argv) == 1 and not (tmp_path / "x").exists()


# ---- model.path = a convert checkpoint ------------------------------------------------------

def _train_one_step_from(rank, world_size, overrides):
    """Trains one step; returns (rank 0) the policy's HF tensors as build_run left them."""
    from megatron_grpo.config import load_config, validate
    from megatron_grpo.convert.export import gather_hf_weights_on_rank0
    from megatron_grpo.trainer import loop

    captured = {}
    build_run = loop.build_run

    def capture_run(cfg):
        run = build_run(cfg)
        captured["start"] = {name: t.clone() for name, t in gather_hf_weights_on_rank0(run.policy, run.model_config)}
        return run

    loop.build_run = capture_run
    cfg = load_config("tiny_cpu", overrides)
    validate(cfg, world_size=world_size)
    loop.train(cfg)
    return captured["start"]


def _model_folder_twice(rank, world_size, ckpt, output_dir, reconvert_from):
    """hf_model_folder on an up-to-date initial_model (kept), then after the checkpoint changed
    (rebuilt). Returns the modification times and the rebuilt weights."""
    from megatron_grpo.convert.cli import main
    from megatron_grpo.convert.model_folder import hf_model_folder
    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel

    initialize_model_parallel(ParallelLayout())
    weights = Path(output_dir) / "initial_model" / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert hf_model_folder(ckpt, output_dir) == Path(output_dir) / "initial_model"
    kept = weights.stat().st_mtime_ns
    assert main(["hf-to-megatron", "--hf", reconvert_from, "--out", ckpt, "--tp", "2", "--force"]) == 0
    initialize_model_parallel(ParallelLayout())  # the tool tears its parallel state down
    hf_model_folder(ckpt, output_dir)
    return before, kept, weights.stat().st_mtime_ns, hf_tensors(weights.parent)


@pytest.mark.slow
def test_training_starts_from_a_convert_checkpoint_without_the_hf_weights(tmp_path):
    from transformers import AutoTokenizer

    from megatron_grpo.data.synthetic import build_tokenizer

    tokenizer_dir = build_tokenizer(tmp_path / "tokenizer")
    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    src = save_tiny_hf_model("qwen3", tmp_path / "hf", seed=4, vocab_size=vocab)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(src)
    ckpt = tmp_path / "mc"
    assert cli(["hf-to-megatron", "--hf", str(src), "--out", str(ckpt), "--tp", "2"]) == 0
    original = hf_tensors(src)
    (src / "model.safetensors").unlink()  # only the Megatron checkpoint holds the weights now

    run_dir = tmp_path / "run"
    overrides = ["data.max_response_length=8", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
                 "rollout.n=4", "logging.console=false", "logging.plot=false", "trainer.total_steps=1",
                 "model.override_config={}", f"model.path={ckpt}", "parallel.tensor=2",
                 f"logging.output_dir={run_dir}"]
    start = run_distributed(_train_one_step_from, 2, (overrides,), timeout=600)[0]
    assert_same_tensors(original, start, "policy at start vs the converted HF model")
    initial = run_dir / "initial_model"
    assert_same_tensors(original, hf_tensors(initial), "initial_model/ exported from the checkpoint")
    assert json.loads((initial / "megatron_source.json").read_text())["checkpoint"] == str(ckpt.resolve())
    assert (initial / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]

    other = save_tiny_hf_model("qwen3", tmp_path / "other", seed=5, vocab_size=vocab)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(other)
    before, kept, rebuilt, weights = run_distributed(_model_folder_twice, 1,
                                                     (str(ckpt), str(run_dir), str(other)), timeout=300)[0]
    assert kept == before  # same checkpoint: initial_model/ is reused
    assert rebuilt != before  # the checkpoint changed: initial_model/ follows it
    assert_same_tensors(hf_tensors(other), weights, "initial_model/ after the checkpoint changed")


def test_writer_makes_a_generation_config_when_the_source_has_none(tmp_path):
    """An HF folder without generation_config.json (a hand-made one) still exports with one:
    transformers' from_model_config choice, the special token ids of config.json."""
    from megatron_grpo.convert.writer import HFWriter

    src = save_tiny_hf_model("llama", tmp_path / "src", seed=6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    (src / "generation_config.json").unlink()
    cfg = ModelArchitecture.from_hf(src)
    with HFWriter(tmp_path / "out", cfg, assets_dir=src) as writer:
        for name, tensor in hf_tensors(src).items():
            writer.add(name, tensor)
    written = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert written == {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    from transformers import GenerationConfig

    assert GenerationConfig.from_pretrained(tmp_path / "out").eos_token_id == 2
