"""A fake SGLang server: the HTTP endpoints and payloads of sglang 0.5 (see
../../shared/reference/sglang-api.md), generating with LocalEngine on CPU.

    python -m tests.fake_sglang.server --model-path DIR --port 30000 [--tp-size 2] [--api-key K]
        [--die-on-generate N] [--fail-first N] [--generate-delay S]

Accepts (and ignores) any other sglang.launch_server flag, so the real launcher can start it.
Weight-update groups are joined over gloo (tp_size 1 only: see init_weights_update_group);
flattened_bucket payloads are read once per TP rank and must agree. Fake-only: GET /fake/weights_digest (sha256 per parameter)."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from megatron_grpo.rollout.local import LocalEngine
from megatron_grpo.rollout.sglang.process_group import destroy_process_group, init_custom_process_group
from megatron_grpo.rollout.sglang.serialization import deserialize, unflatten_bucket
from megatron_grpo.rollout.types import GenerationRequest, SamplingParams
from megatron_grpo.rollout.weights import HFWeightLoader


class HTTPFailure(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class FakeSGLang:
    """Server state: the engine, pause / memory flags, weight-update groups, request counters."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.engine = LocalEngine.from_pretrained(args.model_path)
        self.loader = HFWeightLoader(self.engine.model)
        self.weight_version = "default"
        self.model_path = args.model_path
        self.lock = threading.Lock()
        self.running = 0
        self.generate_count = 0
        self.unpaused = threading.Event()
        self.unpaused.set()
        self.released: set[str] = set()
        self.groups: dict[str, list[Any]] = {}  # group name -> one process group per TP rank
        self.aborted_rids: set[str] = set()

    # ----- /generate --------------------------------------------------------------------------
    def generate(self, body: dict[str, Any]) -> Any:
        with self.lock:
            self.generate_count += 1
            count = self.generate_count
        if self.args.die_on_generate and count >= self.args.die_on_generate:
            os._exit(17)  # a crash while the client waits for the answer
        if count <= self.args.fail_first:
            raise HTTPFailure(503, f"fake overload: failing /generate request {count} of the first {self.args.fail_first}")
        if self.released & {"weights", "kv_cache"}:
            raise HTTPFailure(503, f"{sorted(self.released)} are released (release_memory_occupation); "
                                   f"resume them first")
        self.unpaused.wait()
        input_ids = body.get("input_ids")
        if input_ids is None:
            raise HTTPFailure(400, "this fake server takes input_ids only (no text)")
        batched = bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if batched else [input_ids]
        params = body.get("sampling_params") or {}
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise HTTPFailure(400, f"{len(prompts)} prompts but {len(params_list)} sampling_params")
        requests = [GenerationRequest(tuple(p), _sampling(sp), group_id=str(i))
                    for i, (p, sp) in enumerate(zip(prompts, params_list))]
        rid = body.get("rid")
        with self.lock:
            self.running += 1
        try:
            if self.args.generate_delay:
                time.sleep(self.args.generate_delay)
            if isinstance(rid, str) and rid in self.aborted_rids:
                samples = None
            else:
                samples = self.engine.generate(requests)
        finally:
            with self.lock:
                self.running -= 1
        if samples is None:
            raise HTTPFailure(400, f"request {rid} was aborted")
        outputs = [self._output(s, body.get("return_logprob", False)) for s in samples]
        return outputs if (batched or len(outputs) > 1) else outputs[0]

    def _output(self, sample, return_logprob: bool) -> dict[str, Any]:
        tokenizer = self.engine.tokenizer
        finish: dict[str, Any] = {"type": sample.finish_reason}
        if sample.finish_reason == "stop":
            finish["matched"] = sample.matched_stop
        elif sample.finish_reason == "length":
            finish["length"] = len(sample.response_ids)
        else:
            finish["message"] = "Abort before prefill" if not sample.response_ids else "aborted"
        meta: dict[str, Any] = {"id": os.urandom(8).hex(), "finish_reason": finish,
                                "prompt_tokens": len(sample.prompt_ids),
                                "completion_tokens": len(sample.response_ids),
                                "weight_version": self.weight_version, "e2e_latency": 0.0, "num_retractions": 0}
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(sample.logprobs, sample.response_ids)]
        return {"text": tokenizer.decode(sample.response_ids, skip_special_tokens=True),
                "output_ids": sample.response_ids, "meta_info": meta}

    # ----- control ----------------------------------------------------------------------------
    def pause_generation(self, body: dict[str, Any]) -> dict[str, Any]:
        self.unpaused.clear()
        if (body or {}).get("mode", "abort") == "abort":
            self.engine.abort()
        return {"success": True}

    def continue_generation(self, body: dict[str, Any]) -> dict[str, Any]:
        self.unpaused.set()
        return {"success": True}

    def flush_cache(self, body: Any) -> str:
        if self.running:
            raise HTTPFailure(400, f"Cache not flushed because there are {self.running} running requests.")
        return "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n"

    def abort_request(self, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("abort_all"):
            self.engine.abort()
        elif body.get("rid"):
            self.aborted_rids.add(body["rid"])
        return {"success": True}

    def release_memory(self, body: dict[str, Any]) -> dict[str, Any]:
        self.released |= set((body or {}).get("tags") or ["weights", "kv_cache", "cuda_graph"])
        return {"success": True}

    def resume_memory(self, body: dict[str, Any]) -> dict[str, Any]:
        self.released -= set((body or {}).get("tags") or ["weights", "kv_cache", "cuda_graph"])
        return {"success": True}

    def model_info(self, body: Any) -> dict[str, Any]:
        return {"model_path": self.model_path, "tokenizer_path": self.args.model_path, "is_generation": True,
                "weight_version": self.weight_version, "served_model_name": self.args.model_path,
                "model_type": self.engine.model.config.model_type,
                "architectures": self.engine.model.config.architectures}

    def health_generate(self, body: Any) -> str:
        self.engine.generate([GenerationRequest((1,), SamplingParams(max_new_tokens=1, temperature=0.0))])
        return ""

    # ----- weights ----------------------------------------------------------------------------
    def _apply(self, named_tensors, version: Any, require_all: bool = False) -> None:
        if "weights" in self.released:
            raise HTTPFailure(400, "weights are released; resume_memory_occupation(tags=['weights']) first")
        try:
            self.loader.load(named_tensors, require_all=require_all)
        except ValueError as exc:
            raise HTTPFailure(400, str(exc)) from None
        if version is not None:
            self.weight_version = str(version)

    def update_weights_from_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        from safetensors.torch import load_file

        path = Path(body["model_path"])
        files = sorted(path.glob("*.safetensors"))
        if not files:
            return {"success": False, "message": f"no *.safetensors in {path}"}
        tensors = {}
        for file in files:
            tensors.update(load_file(file))
        self._apply(tensors.items(), body.get("weight_version"), require_all=True)  # a reload: every weight
        self.model_path = str(path)
        return {"success": True, "message": f"loaded {len(tensors)} tensors", "num_paused_requests": 0}

    def init_weights_update_group(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("group_name", "weight_update_group")
        if body.get("backend", "nccl") != "gloo":
            return {"success": False, "message": f"the fake server joins groups over gloo, not {body.get('backend')}"}
        if self.args.tp_size != 1:
            # A real server's TP ranks are separate processes; torch registers a group name once
            # per process, so the fake (one process) can only join as a single rank.
            return {"success": False, "message": "the fake server joins weight-update groups with tp_size 1 only"}
        rank = body["rank_offset"]
        self.groups[name] = [init_custom_process_group("gloo", body["master_address"], body["master_port"], rank,
                                                       body["world_size"], name, timeout_s=self.args.group_timeout)]
        return {"success": True, "message": f"joined {name} as rank {rank}"}

    def update_weights_from_distributed(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("group_name", "weight_update_group")
        if name not in self.groups:
            raise HTTPFailure(400, f"no weights update group {name!r}: call /init_weights_update_group first")
        specs = list(zip(body["names"], body["dtypes"], body["shapes"]))

        def receive(group) -> list[torch.Tensor]:
            out = []
            for _, dtype, shape in specs:
                tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                torch.distributed.broadcast(tensor, group_src=0, group=group)
                out.append(tensor)
            return out

        with ThreadPoolExecutor(len(self.groups[name])) as pool:
            per_rank = list(pool.map(receive, self.groups[name]))
        for rank_tensors in per_rank[1:]:  # every TP worker received the same bytes
            if not all(torch.equal(a, b) for a, b in zip(per_rank[0], rank_tensors)):
                raise HTTPFailure(500, "TP ranks received different tensors")
        self._apply([(n, t) for (n, _, _), t in zip(specs, per_rank[0])], body.get("weight_version"))
        return {"success": True, "message": f"updated {len(specs)} tensors"}

    def destroy_weights_update_group(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("group_name", "weight_update_group")
        for group in self.groups.pop(name, []):
            destroy_process_group(group)
        return {"success": True, "message": f"destroyed {name}"}

    def update_weights_from_tensor(self, body: dict[str, Any]) -> dict[str, Any]:
        payloads = body["serialized_named_tensors"]
        if len(payloads) != self.args.tp_size:
            raise HTTPFailure(400, f"serialized_named_tensors has {len(payloads)} entries, the server has "
                                   f"tp_size={self.args.tp_size} (one per TP rank)")
        if body.get("load_format") != "flattened_bucket":
            raise HTTPFailure(400, f"the fake server takes load_format='flattened_bucket', got {body.get('load_format')!r}")
        per_rank = [unflatten_bucket(deserialize(p)) for p in payloads]
        for other in per_rank[1:]:
            if [n for n, _ in other] != [n for n, _ in per_rank[0]] or not all(
                    torch.equal(a, b) for (_, a), (_, b) in zip(per_rank[0], other)):
                raise HTTPFailure(400, "TP ranks received different tensors")
        self._apply(per_rank[0], body.get("weight_version"))
        return {"success": True, "message": f"updated {len(per_rank[0])} tensors"}

    def get_weights_by_name(self, body: dict[str, Any]) -> Any:
        params = dict(self.engine.model.named_parameters(remove_duplicate=False))
        if body["name"] not in params:
            raise HTTPFailure(400, f"no parameter {body['name']!r}")
        return params[body["name"]].detach()[: body.get("truncate_size", 100)].tolist()

    def all_weights_digest(self, body: Any) -> dict[str, str]:
        return {name: weights_digest(p.detach()) for name, p in self.engine.model.named_parameters(remove_duplicate=False)}


def weights_digest(tensor: torch.Tensor) -> str:
    data = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode() + data).hexdigest()


def _sampling(sp: dict[str, Any]) -> SamplingParams:
    return SamplingParams(n=sp.get("n", 1), temperature=sp.get("temperature", 1.0), top_p=sp.get("top_p", 1.0),
                          top_k=sp.get("top_k", -1), max_new_tokens=sp.get("max_new_tokens", 128),
                          stop=tuple(sp.get("stop") or ()) if not isinstance(sp.get("stop"), str) else (sp["stop"],),
                          stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
                          ignore_eos=sp.get("ignore_eos", False), seed=sp.get("sampling_seed"))


ROUTES = {
    "/generate": "generate", "/pause_generation": "pause_generation", "/continue_generation": "continue_generation",
    "/flush_cache": "flush_cache", "/abort_request": "abort_request",
    "/release_memory_occupation": "release_memory", "/resume_memory_occupation": "resume_memory",
    "/model_info": "model_info", "/get_model_info": "model_info", "/health_generate": "health_generate",
    "/update_weights_from_disk": "update_weights_from_disk",
    "/init_weights_update_group": "init_weights_update_group",
    "/update_weights_from_distributed": "update_weights_from_distributed",
    "/destroy_weights_update_group": "destroy_weights_update_group",
    "/update_weights_from_tensor": "update_weights_from_tensor", "/get_weights_by_name": "get_weights_by_name",
    "/fake/weights_digest": "all_weights_digest",
}


def make_handler(state: FakeSGLang):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:  # keep the log file short
            pass

        def _reply(self, status: int, payload: Any) -> None:
            data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if isinstance(payload, str) else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _handle(self) -> None:
            path = urlsplit(self.path).path
            if state.args.api_key and self.headers.get("Authorization") != f"Bearer {state.args.api_key}":
                return self._reply(401, {"error": "Unauthorized"})
            if path in ("/health", "/ready"):
                return self._reply(200, "")
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else {}
            method = ROUTES.get(path)
            if method is None:
                return self._reply(404, {"detail": "Not Found"})
            try:
                result = getattr(state, method)(body)
            except HTTPFailure as exc:
                return self._reply(exc.status, {"success": False, "message": str(exc)} if exc.status != 400
                                   or path != "/flush_cache" else str(exc))
            except Exception as exc:  # noqa: BLE001 - a server answers 500 with the reason
                return self._reply(500, {"success": False, "message": f"{type(exc).__name__}: {exc}"})
            status = 400 if isinstance(result, dict) and result.get("success") is False else 200
            self._reply(status, result)

        do_GET = do_POST = do_PUT = _handle

    return Handler


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", "--tp", type=int, default=1)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--die-on-generate", type=int, default=0, help="exit on the N-th /generate request")
    parser.add_argument("--fail-first", type=int, default=0, help="answer 503 to the first N /generate requests")
    parser.add_argument("--generate-delay", type=float, default=0.0, help="seconds to sleep in each /generate")
    parser.add_argument("--group-timeout", type=float, default=120.0)
    args, _unknown = parser.parse_known_args(argv)  # other sglang flags are accepted and ignored
    return args


def main(argv: list[str] | None = None) -> None:
    torch.set_num_threads(1)
    args = parse_args(argv)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(FakeSGLang(args)))
    server.daemon_threads = True
    print(f"fake sglang serving {args.model_path} on http://{args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
