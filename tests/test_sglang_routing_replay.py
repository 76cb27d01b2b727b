"""Routing replay (R3) from SGLang: the client asks for SGLang's `return_routed_experts` and decodes
`meta_info["routed_experts"]` into Sample.routed_experts; the trainer replays them.

Here against SGLang 0.5.23's own server code (tests/sglang_harness), for what its real runtime cannot
serve on a CPU: DeepSeek-V3 (MLA; the runtime's torch-native attention refuses MLA's head sizes, see
docs/testing.md), and the harness's own comparisons (a Qwen3-MoE server with and without the flag, the
real sglang-router 0.3.2 in front of a server, which drops the field). Its GetReqInput /
TokenizerManager take the request field, its capturer, `_maybe_collect_routed_experts`, output streamer,
detokenizer (base64) and tokenizer manager (`meta_info`) carry the routes the harness model's routers
chose. Qwen3-MoE's and GLM-4.5's routes, and a trainer replaying GLM-4.5's, run against the real runtime
(tests/test_sglang_runtime.py). The three servers start at once (the module fixture)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatron_grpo.rollout.sglang.http_json import request_json
from tests.sglang_harness.fixtures import launch_router, launch_servers, server_settings

pytestmark = pytest.mark.slow  # starts SGLang test servers

ROUTES_FLAG = "--enable-return-routed-experts"


def _model(root, architecture: str, **overrides):
    from megatron_grpo.data.synthetic import build_tokenizer
    from megatron_grpo.models.tiny import save_tiny_hf_model

    folder = save_tiny_hf_model(architecture, root / architecture, seed=1, **overrides)
    build_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("r3")
    # SGLang 0.5.23's Qwen3MoeForCausalLM builds every layer sparse (sglang_setup.check_sglang_model)
    return {"qwen3_moe": _model(root, "qwen3_moe", mlp_only_layers=[]), "deepseek_v3": _model(root, "deepseek_v3")}


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory):
    """Qwen3-MoE with and without the flag, DeepSeek-V3 with it: three servers started at once."""
    settings = [server_settings(models["qwen3_moe"], extra_args=(ROUTES_FLAG,)),
                server_settings(models["qwen3_moe"]),
                server_settings(models["deepseek_v3"], extra_args=(ROUTES_FLAG,))]
    launcher = launch_servers(tmp_path_factory.mktemp("logs"), settings)
    urls = [s.url for s in launcher.servers]
    yield {"qwen3_moe": urls[0], "no_flag": urls[1], "deepseek_v3": urls[2]}
    launcher.shutdown(grace_s=2)


def _shape(model_dir) -> tuple[int, int]:
    config = json.loads((model_dir / "config.json").read_text())
    return config["num_hidden_layers"], config["num_experts_per_tok"]


def _requests(shape, seed: int = 3):
    from megatron_grpo.rollout.types import GenerationRequest, SamplingParams

    rng = torch.Generator().manual_seed(seed)
    return [GenerationRequest(prompt_ids=tuple(torch.randint(3, 240, (length,), generator=rng).tolist()),
                              sampling=SamplingParams(n=2, max_new_tokens=8, seed=7 + i, ignore_eos=True),
                              group_id=str(i), routed_experts_shape=shape)
            for i, length in enumerate((2, 9, 17))]


def _hf_routes(model_dir, sequence: list[int]) -> torch.Tensor:
    """The HF model's own routes of `sequence` in one full forward (the local engine's recorder on a
    fresh copy of the checkpoint): [len - 1, layers, k], -1 on dense layers."""
    from transformers import AutoModelForCausalLM

    from megatron_grpo.rollout.routed_experts import RoutedExpertsRecorder

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    recorder = RoutedExpertsRecorder(model)
    with torch.no_grad():
        model(torch.tensor([sequence]))
    return recorder.take(1, len(sequence))[0, :-1]


def test_sglang_routes_are_the_models_routes(servers, models):
    """DeepSeek-V3 through SGLang's own request and response path: every sample's routes cover prompt +
    response - 1 positions and equal the model's routing of the whole sequence; dense layers 0."""
    from megatron_grpo.rollout.sglang.client import SGLangClient

    architecture = "deepseek_v3"
    shape = _shape(models[architecture])
    client = SGLangClient([servers[architecture]], concurrency=8)
    try:
        samples = client.generate(_requests(shape))
    finally:
        client.close()
    assert len(samples) == 6
    for sample in samples:
        sequence = sample.prompt_ids + sample.response_ids
        routes = sample.routed_experts
        assert isinstance(routes, np.ndarray) and routes.dtype == np.int32
        assert routes.shape == (len(sequence) - 1, *shape)
        expected = _hf_routes(models[architecture], sequence)
        sparse = (expected >= 0).all(dim=-1).all(dim=0)  # the MoE layers
        assert sparse.sum() == 3
        got = torch.from_numpy(routes)
        assert (got[:, ~sparse] == 0).all()  # SGLang's capture buffer is never written on dense layers
        assert torch.equal(got[:, sparse].sort(dim=-1).values, expected[:, sparse].sort(dim=-1).values)


def test_without_the_server_flag_sglang_ignores_the_field(servers, models):
    """SGLang without --enable-return-routed-experts accepts return_routed_experts and answers without
    routes (no capturer); the client says which flag is missing. /server_info tells the flag."""
    from megatron_grpo.rollout.sglang.client import SGLangClient
    from megatron_grpo.rollout.sglang.errors import SGLangError

    payload = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}, "return_routed_experts": True}
    assert "routed_experts" not in request_json(servers["no_flag"], "/generate", payload)["meta_info"]
    assert "routed_experts" in request_json(servers["qwen3_moe"], "/generate", payload)["meta_info"]
    assert request_json(servers["no_flag"], "/server_info", method="GET")["enable_return_routed_experts"] is False
    assert request_json(servers["qwen3_moe"], "/server_info", method="GET")["enable_return_routed_experts"] is True
    client = SGLangClient([servers["no_flag"]], concurrency=2)
    try:
        with pytest.raises(SGLangError, match="--enable-return-routed-experts"):
            client.generate(_requests(_shape(models["qwen3_moe"]))[:1])
    finally:
        client.close()


def test_sglang_checks_routed_experts_start_len(servers):
    """SGLang's own refusal of a start past the prompt: the request is aborted (HTTP 400)."""
    from megatron_grpo.rollout.sglang.errors import SGLangError

    payload = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}, "return_routed_experts": True,
               "routed_experts_start_len": 4}
    with pytest.raises(SGLangError, match="routed_experts_start_len"):
        request_json(servers["qwen3_moe"], "/generate", payload)


def test_the_sglang_router_drops_return_routed_experts(servers, tmp_path):
    """sglang-router 0.3.2 re-serialises /generate without the field: measured, hence the refusal
    of replay behind a router (config/validate.py)."""
    router = launch_router(tmp_path / "router", [servers["qwen3_moe"]])
    try:
        payload = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}, "return_routed_experts": True}
        answer = request_json(router.router.url, "/generate", payload)
    finally:
        router.shutdown(grace_s=2)
    assert answer["output_ids"] and "routed_experts" not in answer["meta_info"]


def test_replay_with_sglang_validates_and_refuses_only_a_router():
    from megatron_grpo.config import load_config, validate
    from megatron_grpo.errors import ConfigError

    moe = ["model.override_config.model_type=qwen3_moe", "model.override_config.num_experts=8",
           "actor.moe_routing_replay=true", "rollout.engine=sglang"]
    validate(load_config("tiny_cpu", moe))
    for router in ("rollout.sglang.router=true", "rollout.sglang.router_url=http://127.0.0.1:30080"):
        extra = [router] if router.endswith("true") else [router, "rollout.sglang.urls=[http://127.0.0.1:30000]"]
        with pytest.raises(ConfigError, match="the router drops return_routed_experts"):
            validate(load_config("tiny_cpu", [*moe, *extra]))


def test_verls_r3_arguments_translate_to_replay_with_sglang():
    """verl's R3 switches (examples/router_replay: actor router_replay.mode=R3 and the rollout's
    enable_rollout_routing_replay) with an SGLang rollout: a recipe that replays and validates."""
    from megatron_grpo.config import validate
    from megatron_grpo.config.from_verl import config_of, parse_command_line, translate

    parsed = parse_command_line(["actor_rollout_ref.actor.router_replay.mode=R3",
                                 "actor_rollout_ref.rollout.enable_rollout_routing_replay=True",
                                 "actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.n=4",
                                 "data.train_files=[/data/train.parquet]",
                                 "+actor_rollout_ref.model.override_config.model_type=qwen3_moe"])
    config = config_of(translate(parsed))
    assert config.actor.moe_routing_replay and config.rollout.engine == "sglang"
    validate(config)
