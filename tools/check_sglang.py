"""Check a real SGLang server against this trainer's client and weight transports (one GPU node).

    python -m sglang.launch_server --model-path Qwen/Qwen3-0.6B --port 30000 --mem-fraction-static 0.5 &
    python tools/check_sglang.py http://127.0.0.1:30000 --model-path /path/to/Qwen3-0.6B \
        [--backend gloo|nccl] [--shared-dir /tmp/check_sglang] [--tolerance 0.05]

Prints PASS/FAIL per check and exits 1 if any failed:
  health            GET /health_generate, /model_info
  generate          /generate with n=2 and return_logprob parses into Samples (ids, log-probs, finish)
  logprobs          the server's log-probs equal a full-sequence HF forward pass (mean |diff| <= tol)
  disk update       /update_weights_from_disk with perturbed weights: new version, log-probs follow
  distributed       /init_weights_update_group + /update_weights_from_distributed from this process,
                    inside a begin/end_weight_update session
  tensor update     /update_weights_from_tensor (flattened_bucket when sglang imports here, else a
                    plain (name, tensor) list; CUDA IPC on GPU), inside a session
  restore           the original weights go back through the disk transport
Every update is followed by the trainer's post-sync verification (values of sampled tensors via
/get_weights_by_name where the model supports it, /weights_checker checksums).
The perturbation scales lm_head (or the tied embedding) by 1.25, so a stale update is visible in
the log-probs. With one GPU, use --backend gloo (NCCL refuses two ranks on one device)."""
from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_grpo.rollout.sglang.client import SGLangClient  # noqa: E402
from megatron_grpo.rollout.sglang.protocol import parse_weight_version  # noqa: E402
from megatron_grpo.rollout.sglang.verify import WeightSample, verify_engines  # noqa: E402
from megatron_grpo.rollout.sglang.weight_sync import (DiskTransport, DistributedTransport, EngineTarget,  # noqa: E402
                                                      TensorTransport, update_weights)
from megatron_grpo.rollout.types import GenerationRequest, SamplingParams  # noqa: E402

PROMPT_TEXTS = ["Hello, world! What is 2+2?", "The quick brown fox"]


class Checker:
    def __init__(self, args: argparse.Namespace):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.args = args
        tokenizer = AutoTokenizer.from_pretrained(args.model_path)
        self.prompts = [tokenizer.encode(text, add_special_tokens=False) for text in PROMPT_TEXTS]
        self.url = args.url.rstrip("/")
        self.client = SGLangClient([self.url], timeout_s=600.0, api_key=args.api_key)
        self.device = torch.device(args.device)
        self.model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32).to(self.device).eval()
        self.original = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        self.failures = 0
        self.version = 1000
        self.verified = 0

    def run(self, name: str, fn: Callable[[], str]) -> None:
        try:
            detail = fn()
            print(f"PASS  {name}: {detail}", flush=True)
        except Exception as exc:  # noqa: BLE001 - every check reports, then the next one runs
            self.failures += 1
            print(f"FAIL  {name}: {type(exc).__name__}: {exc}", flush=True)
            if self.args.verbose:
                traceback.print_exc()

    # ----- helpers -----------------------------------------------------------------------------
    def perturbed(self, factor: float) -> dict[str, torch.Tensor]:
        state = dict(self.original)
        key = "lm_head.weight" if "lm_head.weight" in state else "model.embed_tokens.weight"
        state[key] = state[key] * factor
        if key == "lm_head.weight" and getattr(self.model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight")  # tied: an HF checkpoint carries the embedding only
            state["model.embed_tokens.weight"] = self.original["model.embed_tokens.weight"] * factor
        return state

    def set_reference(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state, strict=False)

    def compare_logprobs(self, expect_version: int | None) -> str:
        requests = [GenerationRequest(tuple(p), SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=i),
                                      group_id=f"p{i}") for i, p in enumerate(self.prompts)]
        samples = self.client.generate(requests)
        diffs = []
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids], device=self.device)
            with torch.no_grad():
                logits = self.model(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1].float()
            ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.response_ids, device=self.device)[:, None])
            diffs.append((ref.squeeze(1).cpu() - torch.tensor(s.logprobs)).abs())
        diff = torch.cat(diffs)
        versions = {s.weight_version for s in samples}
        if expect_version is not None and versions != {expect_version}:
            raise AssertionError(f"samples carry weight_version {versions}, expected {expect_version}")
        if float(diff.mean()) > self.args.tolerance:
            raise AssertionError(f"mean |logprob diff| {float(diff.mean()):.4f} > {self.args.tolerance} "
                                 f"(max {float(diff.max()):.4f}) over {diff.numel()} tokens")
        return f"mean |diff| {float(diff.mean()):.5f}, max {float(diff.max()):.4f} over {diff.numel()} tokens"

    def push(self, transport, state: dict[str, torch.Tensor]) -> int:
        self.version += 1
        sample = WeightSample(tp_size=self.args.tp_size)
        stats = update_weights(self.client, transport, sample.tap(state.items()), self.version)
        self.set_reference(state)
        info = self.client.call(self.url, "/model_info", method="GET")
        got = parse_weight_version(info.get("weight_version"), f"{self.url}/model_info")
        if got != self.version:
            raise AssertionError(f"/model_info weight_version {got}, expected {self.version}")
        report = verify_engines(self.client, transport.targets, sample)
        self.verified = report.value_checked
        return stats.num_bytes

    # ----- checks -----------------------------------------------------------------------------
    def health(self) -> str:
        self.client.call(self.url, "/health_generate", method="GET")
        info = self.client.call(self.url, "/model_info", method="GET")
        return f"model {info.get('model_path')}, weight_version {info.get('weight_version')}"

    def generate(self) -> str:
        samples = self.client.generate([GenerationRequest(tuple(self.prompts[0]),
                                                          SamplingParams(n=2, max_new_tokens=16))])
        if len(samples) != 2 or any(not s.response_ids for s in samples):
            raise AssertionError(f"expected 2 non-empty samples, got {samples}")
        return (f"2 samples, finish {[s.finish_reason for s in samples]}, "
                f"lengths {[len(s.response_ids) for s in samples]}")

    def disk(self) -> str:
        transport = DiskTransport(self.client, [EngineTarget(self.url)], self.args.shared_dir,
                                  side_files_from=self.args.model_path)
        nbytes = self.push(transport, self.perturbed(1.25))
        return f"{nbytes / 1e9:.2f} GB, {self.verified} tensors verified; " + self.compare_logprobs(self.version)

    def distributed(self) -> str:
        transport = DistributedTransport(self.client, [EngineTarget(self.url, self.args.tp_size)],
                                         self.args.master_address, 0, backend=self.args.backend,
                                         group_name="check-sglang", timeout_s=300)
        transport.device = self.device if self.args.backend == "nccl" else torch.device("cpu")
        transport.connect()
        try:
            nbytes = self.push(transport, self.perturbed(0.8))
        finally:
            transport.close()
        return (f"{nbytes / 1e9:.2f} GB over {self.args.backend}, {self.verified} tensors verified; "
                + self.compare_logprobs(self.version))

    def tensor(self) -> str:
        state = {k: v.to(self.device) for k, v in self.perturbed(1.1).items()}
        flattened = {"auto": None, "flattened": True, "tensors": False}[self.args.tensor_payload]
        transport = TensorTransport(self.client, [EngineTarget(self.url, self.args.tp_size)], flattened=flattened)
        nbytes = self.push(transport, state)
        how = "CUDA IPC" if self.device.type == "cuda" else "shared memory"
        return (f"{nbytes / 1e9:.2f} GB via {how}, {self.verified} tensors verified; "
                + self.compare_logprobs(self.version))

    def restore(self) -> str:
        transport = DiskTransport(self.client, [EngineTarget(self.url)], self.args.shared_dir,
                                  side_files_from=self.args.model_path)
        self.push(transport, self.original)
        return self.compare_logprobs(self.version)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="the SGLang server, e.g. http://127.0.0.1:30000")
    parser.add_argument("--model-path", required=True, help="the HF folder the server was launched with")
    parser.add_argument("--tp-size", type=int, default=1, help="the server's --tp-size")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--master-address", default="127.0.0.1")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shared-dir", default=None, help="a folder the server can read (default: a temp dir)")
    parser.add_argument("--tolerance", type=float, default=0.05, help="max mean |logprob diff| (bf16 server)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--tensor-payload", default="auto", choices=["auto", "flattened", "tensors"],
                        help="flattened: SGLang's flattened_bucket (needs sglang importable here); tensors: a "
                             "plain (name, tensor) list; auto: flattened when sglang imports")
    parser.add_argument("--skip", nargs="*", default=[], help="checks to skip, e.g. tensor distributed")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    args.shared_dir = args.shared_dir or tempfile.mkdtemp(prefix="check_sglang_")

    checker = Checker(args)
    checks = [("health", checker.health), ("generate", checker.generate),
              ("logprobs", lambda: checker.compare_logprobs(None)), ("disk", checker.disk),
              ("distributed", checker.distributed), ("tensor", checker.tensor), ("restore", checker.restore)]
    for name, fn in checks:
        if name in args.skip:
            print(f"SKIP  {name}")
            continue
        checker.run(name, fn)
    print(f"{'FAIL' if checker.failures else 'PASS'}: {checker.failures} of {len(checks)} checks failed")
    sys.exit(1 if checker.failures else 0)


if __name__ == "__main__":
    main()
