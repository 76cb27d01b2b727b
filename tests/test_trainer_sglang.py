"""The trainer with rollout.engine=sglang against two protocol-faithful fake SGLang servers: rollouts
over HTTP, and after every step the new weights reach both servers (distributed and disk transports)."""
import json
import urllib.request

import pytest

from megatron_grpo.testing.distributed import run_distributed
from tests.fake_sglang.fixtures import fake_server_settings, launch_fake_servers


def _train(rank, world_size, overrides):
    from megatron_grpo.config import load_config
    from megatron_grpo.trainer.loop import train

    cfg = load_config("tiny_cpu", overrides)
    train(cfg)
    with open(f"{cfg.logging.output_dir}/metrics.jsonl") as handle:
        return [json.loads(line) for line in handle] if rank == 0 else None


def _model_info(url):
    with urllib.request.urlopen(f"{url}/model_info", timeout=30) as response:
        return json.load(response)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    from megatron_grpo.data.synthetic import build_tokenizer
    from megatron_grpo.models.tiny import save_tiny_hf_model

    folder = tmp_path_factory.mktemp("policy") / "qwen3"
    save_tiny_hf_model("qwen3", folder, seed=0, num_hidden_layers=2)
    build_tokenizer(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["distributed", "disk"])
def test_trainer_drives_fake_sglang_servers(tmp_path, policy_dir, transport):
    launcher = launch_fake_servers(tmp_path / "logs", [fake_server_settings(policy_dir) for _ in range(2)])
    try:
        urls = [server.url for server in launcher.servers]
        records = run_distributed(_train, 2, ([
            f"model.path={policy_dir}", "model.make_vocab_size_divisible_by=8", "rollout.engine=sglang",
            f"rollout.sglang.urls=[{','.join(urls)}]", f"rollout.sglang.weight_sync={transport}",
            "trainer.total_steps=3", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4",
            f"logging.output_dir={tmp_path / 'run'}", "logging.console=false", "logging.plot=false",
            "eval.interval=-1", "actor.optim.lr=1e-2"],), timeout=600)[0]
        assert [r["step"] for r in records] == [1, 2, 3]
        # The servers sampled steps 2 and 3 with the weights the trainer had after steps 1 and 2:
        # their log-probs equal the trainer's recomputation (they would not after a missed sync).
        for record in records:
            assert record["actor/logprob_abs_diff_max"] < 1e-4, record["actor/logprob_abs_diff_max"]
        assert records[1]["actor/grad_norm"] > 0
        assert [str(_model_info(url)["weight_version"]) for url in urls] == ["3", "3"]  # a string in SGLang
    finally:
        launcher.shutdown(grace_s=2)


def test_unreachable_server_names_the_url(tmp_path, policy_dir):
    from megatron_grpo.testing.distributed import DistributedChildError, free_port

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(DistributedChildError, match=url.replace(".", r"\.")):
        run_distributed(_train, 1, ([f"model.path={policy_dir}", "model.make_vocab_size_divisible_by=8",
                                     "rollout.engine=sglang", f"rollout.sglang.urls=[{url}]",
                                     "rollout.sglang.weight_sync=disk", "rollout.sglang.max_retries=0",
                                     f"logging.output_dir={tmp_path}", "logging.console=false"],), timeout=300)


@pytest.mark.slow
def test_all_servers_dying_mid_run_checkpoints_then_fails(tmp_path, policy_dir):
    from megatron_grpo.testing.distributed import DistributedChildError

    # 8 prompts per step, one request each, round robin: each server dies on its 6th request (step 2).
    settings = [fake_server_settings(policy_dir, extra_args=["--die-on-generate", "6"]) for _ in range(2)]
    launcher = launch_fake_servers(tmp_path / "logs", settings)
    try:
        urls = [server.url for server in launcher.servers]
        with pytest.raises(DistributedChildError) as failure:
            run_distributed(_train, 2, ([
                f"model.path={policy_dir}", "model.make_vocab_size_divisible_by=8", "rollout.engine=sglang",
                f"rollout.sglang.urls=[{','.join(urls)}]", "rollout.sglang.weight_sync=disk",
                "rollout.sglang.max_retries=1", "trainer.total_steps=4", "data.train_batch_size=8",
                "actor.ppo_mini_batch_size=8", "rollout.n=4", f"logging.output_dir={tmp_path / 'run'}",
                "logging.console=false", "logging.plot=false", "eval.interval=-1"],), timeout=600)
        message = str(failure.value)
        # Every rank stops with the rollout error, which names a server it could not reach (which
        # one depends on the order the two servers died in).
        assert "RolloutFailure" in message, message
        assert "cannot reach the SGLang server" in message and any(url in message for url in urls), message
        assert (tmp_path / "run" / "checkpoints" / "step_1" / "complete.json").is_file()
    finally:
        launcher.shutdown(grace_s=2)
