"""`megatron-grpo export`: a training run saved at TP=2 x PP=2 -> an HF folder written by ONE
process -> transformers computes the trainer's logits; checkpoint.save_hf's write_hf_export
writes the same files from the live policy; every accepted path form names the same weights."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_grpo.testing.distributed import run_distributed

REPO = Path(__file__).resolve().parents[1]
TINY_FAST = ["data.max_response_length=8", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
             "rollout.n=4", "logging.console=false", "logging.plot=false"]
# Token ids of the synthetic task's tokenizer (24 tokens); any fixed sequence will do.
TOKENS = [1, 5, 9, 4, 7, 2, 13, 6, 20, 3, 11, 8, 17, 0, 22, 5]


def megatron_grpo(*argv: str) -> subprocess.CompletedProcess:
    """The real CLI in a fresh process (as a user runs it)."""
    return subprocess.run([sys.executable, "-m", "megatron_grpo.cli", *argv], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def policy_logits(run, tokens: list[int]) -> torch.Tensor | None:
    """The policy's full-vocabulary logits [s, vocab] for `tokens`, through the trainer's own
    pipeline schedule; returned by the last stage (None elsewhere)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_grpo.trainer.batches.batching import TrainSample, collate
    from megatron_grpo.trainer.batches.micro_batches import pad_to_common_shape
    from megatron_grpo.trainer.step.train_step import _run_schedule

    samples = [TrainSample(prompt_ids=tokens[:4], response_ids=tokens[4:], advantage=0.0)]
    micro_batches = pad_to_common_shape([collate(samples, [0])])

    def keep_logits(micro_batch, logits):
        full = gather_from_tensor_model_parallel_region(logits)  # [b, s, padded vocab]
        return torch.zeros(()), {"logits": full[0, :, : run.model_config.vocab_size].detach().clone()}

    with torch.no_grad():
        outputs = _run_schedule(run.policy, micro_batches, keep_logits, forward_only=True, device=run.device)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return outputs[0]["logits"]


def _train_then_probe(rank, world_size, overrides, live_hf_dir, with_logits):
    """Trains the tiny recipe; then, with the trained policy still in memory, its logits on TOKENS
    (with_logits; the probe feeds whole sequences, so not under context parallelism) and
    write_hf_export of it (what checkpoint.save_hf calls) into live_hf_dir."""
    from megatron_grpo.config import load_config, validate
    from megatron_grpo.convert.to_hf import write_hf_export
    from megatron_grpo.trainer import loop

    captured = {}
    build_run = loop.build_run

    def capture_run(cfg):
        captured["run"] = build_run(cfg)
        return captured["run"]

    loop.build_run = capture_run
    cfg = load_config("tiny_cpu", overrides)
    validate(cfg, world_size=world_size)
    loop.train(cfg)
    run = captured["run"]
    logits = policy_logits(run, TOKENS) if with_logits else None
    written = write_hf_export(run.policy, run.model_config, run.model_dir, live_hf_dir)
    return {"logits": logits, "written": str(written)}


def train_and_probe(root: Path, world_size: int, layout: list[str], with_logits: bool = True) -> dict:
    """The tiny recipe trained 2 steps at `layout` (checkpoint at step 2), with the probes above."""
    run_dir = root / "run"
    overrides = [*TINY_FAST, "trainer.total_steps=2", "checkpoint.save_interval=2", *layout,
                 f"logging.output_dir={run_dir}"]
    results = run_distributed(_train_then_probe, world_size, (overrides, str(root / "live"), with_logits),
                              timeout=600)
    last_stage = [r["logits"] for r in results if r["logits"] is not None]
    assert all(torch.equal(logits, last_stage[0]) for logits in last_stage)  # TP ranks of the last stage agree
    return {"run": run_dir, "root": root, "logits": last_stage[0] if last_stage else None,
            "live_hf": root / "live" / "hf"}


@pytest.fixture(scope="module")
def trained_tp2_pp2(tmp_path_factory):
    """Trained at TP=2 x PP=2 (4 gloo processes)."""
    return train_and_probe(tmp_path_factory.mktemp("export"), 4, ["parallel.tensor=2", "parallel.pipeline=2",
                                                                    "checkpoint.save_hf=true"])


@pytest.mark.slow
def test_export_tp2_pp2_run_on_one_process_gives_the_trainers_logits(trained_tp2_pp2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, out = trained_tp2_pp2["run"], trained_tp2_pp2["root"] / "exported"
    result = megatron_grpo("export", str(run), "--out", str(out))  # one process: loaded at TP=1, PP=1
    assert result.returncode == 0, result.stderr
    assert f"wrote {out} (from step 2 of {run / 'checkpoints' / 'step_2'})" in result.stdout

    initial = run / "initial_model"
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (initial / name).read_bytes(), name
    exported = hf_tensors(out)
    assert sorted(exported) == sorted(hf_tensors(initial))
    assert any(not torch.equal(exported[n], t) for n, t in hf_tensors(initial).items())  # trained, not initial

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(str(out)).convert_ids_to_tokens(TOKENS[:3])
    with torch.no_grad():
        hf = model(torch.tensor([TOKENS])).logits[0]
        reference = model.double()(torch.tensor([TOKENS])).logits[0]  # same weights, float64 math
    trainer = trained_tp2_pp2["logits"]
    scale = reference.abs().max().item()
    rel = (hf.double() - trainer.double()).abs().max().item() / scale
    rel_trainer_64 = (trainer.double() - reference).abs().max().item() / scale
    rel_hf_64 = (hf.double() - reference).abs().max().item() / scale
    print(f"\nexported HF vs trainer (TP2xPP2) logits: max |diff| / max |logit| = {rel:.3g} "
          f"(trainer vs float64 {rel_trainer_64:.3g}, HF fp32 vs float64 {rel_hf_64:.3g}, max |logit| {scale:.3g})")
    # Both are fp32 evaluations of the same weights; they differ only by rounding (fp32 eps 1.2e-7,
    # summed over a few dozen accumulation steps): 1e-5 is the bound, far above that.
    assert rel <= 1e-5


@pytest.mark.slow
def test_save_hf_writes_the_same_folder_from_the_live_policy(trained_tp2_pp2):
    """checkpoint.save_hf's step_2/hf, and write_hf_export of the TP2xPP2 policy in memory, equal
    the export of the step's Megatron checkpoint, file by file."""
    run, live = trained_tp2_pp2["run"], trained_tp2_pp2["live_hf"]
    out = trained_tp2_pp2["root"] / "from_step_folder"
    step = run / "checkpoints" / "step_2"
    result = megatron_grpo("convert", "megatron-to-hf", "--ckpt", str(step), "--out", str(out))
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in out.iterdir())
    recorded = json.loads((step / "complete.json").read_text())["files"]
    for folder in (live, step / "hf"):
        assert sorted(p.name for p in folder.iterdir()) == names, folder
        for name in names:
            assert (folder / name).read_bytes() == (out / name).read_bytes(), (folder, name)
    assert all(f"hf/{name}" in recorded for name in names)  # saved with the step, covered by its marker


@pytest.mark.slow
def test_export_of_a_cp2_dp2_distributed_optimizer_run_is_the_live_policy(tmp_path):
    """Context and data parallel replicas, the optimizer state sharded over DP: the one-process
    export reads the model alone and equals what the trainer held, bitwise."""
    trained = train_and_probe(tmp_path, 4, ["parallel.context=2", "parallel.use_distributed_optimizer=true"],
                              with_logits=False)
    out = tmp_path / "exported"
    result = megatron_grpo("export", str(trained["run"] / "checkpoints"), "--step", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr
    state = json.loads((trained["run"] / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    saved_at = {key: state["layout"][key] for key in ("world_size", "tp", "pp", "cp", "dp")}
    assert saved_at == {"world_size": 4, "tp": 1, "pp": 1, "cp": 2, "dp": 2}
    live, exported = hf_tensors(trained["live_hf"]), hf_tensors(out)
    assert sorted(live) == sorted(exported)
    assert all(torch.equal(live[name], exported[name]) for name in live)


@pytest.mark.slow
def test_every_path_form_names_the_same_checkpoint(trained_tp2_pp2):
    from megatron_grpo.convert.sources import resolve_source

    run = trained_tp2_pp2["run"]
    step = run / "checkpoints" / "step_2"
    forms = [run, run / "checkpoints", step, step / "model_optim"]
    sources = [resolve_source(form) for form in forms] + [resolve_source(run, step=2)]
    for source in sources:
        assert source.weights_dir == step / "model_optim" and source.step == 2
        assert source.assets_dir == run / "initial_model"
        # TP=2 padded the vocabulary to 256 rows; the stored shape says so, whatever layout loads it.
        assert source.model_config.padded_vocab_size == 256 and source.model_config.vocab_size == 24
    info = json.loads((step / "complete.json").read_text())
    assert info["world_size"] == 4
