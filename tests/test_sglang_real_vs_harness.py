"""One request script sent to a real SGLang 0.5.23 engine on this CPU and to a harness engine
(tests/sglang_harness: SGLang's HTTP app in front of the project's own scheduler), both started by
the project's launcher with the same rollout-like settings (device cpu, float32, a capped KV cache,
an API key) from the runtime venv's interpreter: per request, the HTTP status, the answer's keys
(meta_info's recursively) and the error message must be the same. The harness may never be kinder
than the runtime: where they differed, the harness was changed to answer as SGLang does. Found so:
- /weights_checker: the harness reported HF names (q_proj, gate_proj...) and the unpadded
  vocabulary; SGLang reports its fused qkv_proj / gate_up_proj and pads the embedding and LM head
  to a multiple of 64 rows (harness: model.py SGLangLayout);
- a request with max_new_tokens=0: the harness sampled a token for it (one output log-prob, and a
  sampling mask when asked); SGLang samples nothing (no output log-prob; with return_sampling_mask,
  HTTP 500 "The sampling backend did not return captured sampling support.", and so for any n > 1
  request with return_sampling_mask, whose prefix warm-up is such a request): scheduler.py
  _finish_prefill_only.
The script's other 41 steps (of 45) answered alike before the fixes, the greedy tokens too."""
from __future__ import annotations

import dataclasses
import http.client
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.sglang_harness.fixtures import SERVER_MODULE, harness_checksums, harness_env
from tests.sglang_runtime_fixtures import real_server_settings, runtime_env, runtime_python

pytestmark = [pytest.mark.sglang_runtime]

API_KEY = "real-vs-harness-key"
PROMPT = [5, 17, 33, 2, 41, 9]
# What the project reads of /server_info (trainer/engines/sglang_setup.py, rollout/sglang/colocated.py,
# expected_checksums.EngineLayout.of): the value too must agree.
SERVER_INFO_READ = ("enable_deterministic_inference", "enable_return_routed_experts", "enable_fp32_lm_head",
                    "base_gpu_id", "dtype", "device", "tp_size", "pp_size", "dp_size", "quantization",
                    "enable_dp_attention", "enable_dp_lm_head")


@dataclass
class Answer:
    status: int
    body: Any  # decoded JSON, or the text


def call(url: str, path: str, payload: Any = None, *, method: str = "POST", api_key: str | None = API_KEY,
         timeout_s: float = 120.0) -> Answer:
    """One request, whatever its status (the project's request_json raises on 4xx/5xx)."""
    host, port = url.removeprefix("http://").split(":")
    headers = {"Content-Type": "application/json"} if payload is not None else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request(method, path, body=None if payload is None else json.dumps(payload), headers=headers)
        response = conn.getresponse()
        text = response.read().decode("utf-8", errors="replace")
        status = response.status
    except (ConnectionError, http.client.HTTPException, OSError) as exc:  # the server died: a status too
        return Answer(0, f"no answer: {type(exc).__name__}")
    finally:
        conn.close()
    try:
        return Answer(status, json.loads(text) if text else None)
    except json.JSONDecodeError:
        return Answer(status, text)


def shape(body: Any, prefix: str = "") -> list[str]:
    """The keys of an answer: a dict's keys, meta_info's (and error's) recursively; a list's items'
    keys with [] (and how many items)."""
    if isinstance(body, list):
        items = [shape(item, f"{prefix}[]") for item in body if isinstance(item, (dict, list))]
        return [f"{prefix}[{len(body)}]"] + sorted({key for item in items for key in item})
    if not isinstance(body, dict):
        return []
    keys = []
    for key, value in body.items():
        keys.append(f"{prefix}{key}")
        if key in ("meta_info", "error", "finish_reason") and isinstance(value, dict):
            keys += shape(value, f"{prefix}{key}.")
        elif key in ("meta_info",) and isinstance(value, list):
            keys += shape(value, f"{prefix}{key}")
    return sorted(keys)


def message(answer: Answer) -> str | None:
    """An error answer's message, as SGLang words it (its bodies differ by route)."""
    if answer.status < 400:
        body = answer.body
        return body.get("message") if isinstance(body, dict) and body.get("success") is False else None
    body = answer.body
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            return error.get("message")
        return body.get("message") or body.get("detail") or json.dumps(body, sort_keys=True)
    return body


def outputs(body: Any, tokens: bool) -> list[dict] | None:
    """Per /generate output: how many tokens, why it finished, and the length of each list in its
    meta_info (log-probs, masks); the tokens themselves where they are deterministic."""
    if not isinstance(body, (dict, list)) or (isinstance(body, dict) and "output_ids" not in body):
        return None
    summary = []
    for item in body if isinstance(body, list) else [body]:
        meta = item.get("meta_info") or {}
        finish = meta.get("finish_reason") or {}
        summary.append({"output_ids": item["output_ids"] if tokens else len(item["output_ids"]),
                        "finish_reason": finish if tokens else finish.get("type"),
                        **{f"len {key}": len(value) for key, value in meta.items() if isinstance(value, list)}})
    return summary


def record(name: str, answer: Answer, tokens: bool = False, **extra) -> dict:
    return {"step": name, "status": answer.status, "keys": shape(answer.body), "message": message(answer),
            "outputs": outputs(answer.body, tokens), **extra}


def greedy(max_new_tokens: int = 4, **more) -> dict:
    return {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": -1,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, **more}}


def sampled(n: int = 1, max_new_tokens: int = 4, **more) -> dict:
    """Truncated sampling as the project asks for it (protocol.py), to the length asked for."""
    return {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": -1,
            "sampling_params": {"n": n, "temperature": 1.0, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                "max_new_tokens": max_new_tokens, "stop": [], "stop_token_ids": [],
                                "ignore_eos": True, **more}}


MASK = {"return_sampling_mask": True, "sampling_logprobs_mode": "selected"}


def run_script(url: str, model_dir: Path, edited: dict[str, torch.Tensor]) -> list[dict]:
    """The request script; each step's record (status, keys, message, and what must agree besides)."""
    from megatron_grpo.rollout.sglang.serialization import serialize, tensor_payload

    steps = []

    def step(name, path, payload=None, method="POST", api_key=API_KEY, tokens=False, **extra):
        answer = call(url, path, payload, method=method, api_key=api_key)
        steps.append(record(name, answer, tokens, **extra))
        return answer

    step("health", "/health", method="GET")
    step("health_generate", "/health_generate", method="GET")
    info = call(url, "/server_info", method="GET").body
    steps.append({"step": "server_info read by the project", "status": 200,
                  "values": {key: info.get(key, "<absent>") for key in SERVER_INFO_READ}})
    model_info = step("model_info", "/model_info", method="GET")
    steps[-1]["weight_version"] = model_info.body.get("weight_version")

    first = step("generate greedy + logprobs", "/generate", greedy(), tokens=True)
    step("generate n=3, top_p/top_k/min_p", "/generate", sampled(n=3))
    step("generate sampling mask", "/generate", {**sampled(), **MASK})
    step("generate sampling mask, greedy", "/generate", {**greedy(), **MASK}, tokens=True)
    step("generate sampling mask, n=2", "/generate", {**sampled(n=2), **MASK})
    step("generate sampling mask, max_new_tokens 0", "/generate", {**sampled(max_new_tokens=0), **MASK})
    step("generate sampling mask, top_k over the cap", "/generate", {**sampled(top_k=5000), **MASK})
    step("generate sampling mask, no top_k", "/generate", {**sampled(top_k=-1), **MASK})
    stop_at = first.body["output_ids"][1]
    step("generate stop_token_ids", "/generate", greedy(max_new_tokens=6, stop_token_ids=[stop_at]), tokens=True)
    step("generate unknown sampling key", "/generate", greedy(no_such_sampling_key=1))
    step("generate max_new_tokens 0", "/generate", greedy(max_new_tokens=0), tokens=True)
    step("generate without input", "/generate", {"sampling_params": {"max_new_tokens": 2}})
    seeded = sampled(max_new_tokens=24, sampling_seed=1234, temperature=1.5, top_k=-1, top_p=1.0, min_p=0.0)
    once, again = (call(url, "/generate", seeded).body["output_ids"] for _ in range(2))
    # SGLang uses sampling_seed only under --enable-deterministic-inference (which a CPU engine refuses)
    steps.append({"step": "sampling_seed without deterministic inference", "status": 200,
                  "same_tokens_twice": once == again})

    step("abort_request all", "/abort_request", {"abort_all": True})
    step("abort_request unknown rid", "/abort_request", {"rid": "no-such-request"})
    step("pause_generation abort", "/pause_generation", {"mode": "abort"})
    step("continue_generation", "/continue_generation", {})
    step("flush_cache", "/flush_cache", {})

    def tensor_update(tensors, flattened, version):
        payload = tensor_payload(list(tensors.items()), flattened)
        return {"serialized_named_tensors": [serialize(payload.obj)], "load_format": payload.load_format,
                "flush_cache": False, "weight_version": str(version)}

    names = sorted(edited)
    step("update_weights_from_tensor outside a session", "/update_weights_from_tensor",
         tensor_update({names[0]: edited[names[0]]}, False, 1))
    step("begin_weight_update", "/begin_weight_update", {})
    half = len(names) // 2
    step("update_weights_from_tensor, plain list", "/update_weights_from_tensor",
         tensor_update({n: edited[n] for n in names[:half]}, False, 1))
    step("update_weights_from_tensor, flattened bucket", "/update_weights_from_tensor",
         tensor_update({n: edited[n] for n in names[half:]}, True, 1))
    step("update_weights_from_tensor, an unknown name", "/update_weights_from_tensor",
         tensor_update({"model.layers.0.self_attn.no_such_proj.weight": torch.ones(4, 4)}, False, 1))
    step("end_weight_update", "/end_weight_update", {})
    checked = step("weights_checker checksum", "/weights_checker", {"action": "checksum"})
    ranks = [rank.get("checksums", {}) for rank in (checked.body or {}).get("ranks", [])]
    steps[-1]["checksums"] = ranks  # the same weights in the same layout: the same names and values
    steps[-1]["rank_keys"] = sorted({key for rank in (checked.body or {}).get("ranks", []) for key in rank})
    # every parameter, as the trainer predicts it from the HF tensors (rollout/sglang/expected_checksums.py)
    steps[-1]["as_predicted"] = ranks == harness_checksums(model_dir, edited)
    step("weights_checker unknown action", "/weights_checker", {"action": "no_such_action"})
    step("get_weights_by_name", "/get_weights_by_name", {"name": "model.layers.0.self_attn.q_proj.weight",
                                                         "truncate_size": 2})
    step("update_weights_from_disk", "/update_weights_from_disk", {
        "model_path": str(model_dir), "weight_version": "2", "flush_cache": False})
    step("update_weights_from_disk, missing folder", "/update_weights_from_disk", {
        "model_path": str(model_dir / "no-such-folder"), "weight_version": "3"})
    after = [rank["checksums"] for rank in call(url, "/weights_checker", {"action": "checksum"}).body["ranks"]]
    steps.append({"step": "weights_checker after the disk update", "status": 200,
                  "as_predicted": after == harness_checksums(model_dir, {})})
    step("model_info after updates", "/model_info", method="GET")
    steps[-1]["weight_version"] = call(url, "/model_info", method="GET").body.get("weight_version")

    step("generate without the key", "/generate", greedy(), api_key=None)
    step("generate with a wrong key", "/generate", greedy(), api_key="wrong")
    step("update_weights_from_disk without the key", "/update_weights_from_disk",
         {"model_path": str(model_dir)}, api_key=None)
    step("weights_checker without the key", "/weights_checker", {"action": "checksum"}, api_key=None)
    step("health without the key", "/health", method="GET", api_key=None)
    step("no such route", "/no_such_route", {})
    # last: a wrong shape may take the server down
    step("begin_weight_update again", "/begin_weight_update", {})
    step("update_weights_from_tensor, a wrong shape", "/update_weights_from_tensor",
         tensor_update({"model.norm.weight": torch.ones(65)}, False, 3))
    step("end_weight_update again", "/end_weight_update", {})
    step("health after the wrong shape", "/health", method="GET")
    return steps


def edited_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Layer 0's attention and MLP projections and the embedding, changed (q/k/v and gate/up: SGLang
    fuses them; the embedding: it pads the vocabulary)."""
    from safetensors.torch import load_file

    weights = load_file(str(model_dir / "model.safetensors"))
    weights = {name: weights[name] for name in ["model.embed_tokens.weight", *(
        f"model.layers.0.{part}.weight" for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                     "mlp.down_proj"))]}
    generator = torch.Generator().manual_seed(0)
    return {name: tensor + 0.01 * torch.randn(tensor.shape, generator=generator) for name, tensor in weights.items()}


@pytest.fixture(scope="module")
def scripts(tmp_path_factory) -> dict[str, list[dict]]:
    from megatron_grpo.rollout.sglang.launcher import SGLangLauncher
    from tests.tiny_hf import save_tiny_model

    python = runtime_python()
    folder = tmp_path_factory.mktemp("real_vs_harness")
    model_dir = save_tiny_model(folder / "model", seed=0, scale=2.0)
    real = real_server_settings(model_dir, api_key=API_KEY)
    harness = dataclasses.replace(real_server_settings(model_dir, api_key=API_KEY),
                                  command=(python, "-m", SERVER_MODULE))
    # both start at once (the launcher waits on each in turn)
    launchers = {"real": SGLangLauncher([real], folder / "real_logs", env=runtime_env()),
                 "harness": SGLangLauncher([harness], folder / "harness_logs", env=harness_env())}
    try:
        for launcher in launchers.values():
            launcher.start()
        for launcher in launchers.values():
            launcher.wait_healthy(timeout_s=300, poll_s=0.5)
        edited = edited_tensors(model_dir)
        with ThreadPoolExecutor(len(launchers)) as pool:  # the two servers answer the script side by side
            futures = {name: pool.submit(run_script, launcher.servers[0].url, model_dir, edited)
                       for name, launcher in launchers.items()}
            return {name: future.result() for name, future in futures.items()}
    finally:
        with ThreadPoolExecutor(len(launchers)) as pool:
            list(pool.map(lambda launcher: launcher.shutdown(grace_s=5), launchers.values()))


def test_real_and_harness_answer_the_script_alike(scripts):
    real, harness = scripts["real"], scripts["harness"]
    assert [s["step"] for s in real] == [s["step"] for s in harness]
    differences = [{"real": r, "harness": h} for r, h in zip(real, harness) if r != h]
    assert not differences, json.dumps(differences, indent=1)


def test_the_script_meets_what_the_project_relies_on(scripts):
    """What the project's client and trainer rely on, on the real engine (the harness answers alike)."""
    steps = {s["step"]: s for s in scripts["real"]}
    # SGLang's fused parameters, and every one of them as the trainer predicts from the HF tensors
    checked = steps["weights_checker checksum"]
    assert "model.layers.0.self_attn.qkv_proj.weight" in checked["checksums"][0] and checked["as_predicted"]
    assert steps["weights_checker after the disk update"]["as_predicted"]
    # protocol.py: masks only for n=1 requests; SGLang refuses the rest
    assert (steps["generate sampling mask"]["status"], steps["generate sampling mask, n=2"]["status"]) == (200, 500)
    assert steps["generate sampling mask, top_k over the cap"]["status"] == 400
    assert steps["update_weights_from_tensor outside a session"]["status"] == 400  # weight_sync's sessions
    assert steps["get_weights_by_name"]["message"] == "Get parameter by name failed"  # Qwen3: verify.py's 400
    assert [steps[f"{route} without the key"]["status"] for route in (
        "generate", "update_weights_from_disk", "weights_checker", "health")] == [401, 401, 401, 200]
    assert not steps["sampling_seed without deterministic inference"]["same_tokens_twice"]
    assert steps["model_info after updates"]["weight_version"] == "2"
