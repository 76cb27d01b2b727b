"""Routed-experts capture (SGLang's `--enable-return-routed-experts`, routing replay's engine side)
for the CPU scheduler, on SGLang's own capturer code.

What SGLang 0.5.23 does, and what runs here:
- `RoutedExpertsCapturer.create` (state_capturer/routed_experts.py) makes a capturer only when the
  server runs with `--enable-return-routed-experts` (`get_exec().features.enable_return_routed_experts`);
  without it a request's `return_routed_experts` is accepted and ignored (no capturer:
  `_maybe_collect_routed_experts` returns at once, and `meta_info` has no `routed_experts`). Same here.
- Every MoE layer's top-k (`capture_routed_experts_if_allowed` in layers/moe/topk.py, the logical expert
  ids, before any EPLB remap) goes into a device buffer [tokens of the forward, num_hidden_layers,
  top_k] at its layer id (`BaseDeviceCache.capture`); dense layers are never written, so they read 0.
  Here a forward hook on each HF MoE block's router feeds SGLang's own `capture` the ids the HF
  router chose (transformers 5 routers return (logits, weights, indices)).
- After the forward, `BaseTopkCapturer.on_forward_end` copies the rows to a host buffer indexed by
  the tokens' KV-cache locations (`out_cache_loc`); a finished request's
  `SchedulerBatchResultProcessor._maybe_collect_routed_experts` reads its locations
  `req_to_token[req_pool_idx][start_len : seqlen - 1]` (seqlen = prompt + output through the stop),
  and SGLang's output streamer, detokenizer (base64 of the int32 bytes) and tokenizer manager put
  them into `meta_info["routed_experts"]`. All of that is SGLang's code here too: the host buffer is
  a plain CPU tensor (SGLang's pins it with cudaHostRegister), the KV "locations" come from a free
  list (HF's cache has none), one per fed token.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

# host rows (token locations) and device rows (tokens of one forward) the harness keeps at most
MAX_CAPTURED_TOKENS = 1 << 16


class ReqToTokenRows(dict):
    """SGLang's ReqToTokenPool.req_to_token as `_maybe_collect_routed_experts` reads it:
    req_to_token[req_pool_idx] -> the request's token locations (a 1-D tensor)."""


class RoutedExpertsCapture:
    """SGLang's capturer for one CPU scheduler (None from `create` without the server flag)."""

    @staticmethod
    def create(model: torch.nn.Module, model_config) -> "RoutedExpertsCapture | None":
        from sglang.srt.runtime_context import get_exec

        if not get_exec().features.enable_return_routed_experts:
            return None
        return RoutedExpertsCapture(model, model_config)

    def __init__(self, model: torch.nn.Module, model_config):
        from sglang.srt.state_capturer.base import BaseDeviceCache, BaseTopkCapturer
        from sglang.srt.state_capturer.routed_experts import set_global_experts_capturer

        text = model_config.hf_text_config
        num_layers, top_k = text.num_hidden_layers, text.num_experts_per_tok
        rows = min(int(model_config.context_len), MAX_CAPTURED_TOKENS)
        # SGLang's BaseTopkCapturer, without its __init__ (whose host buffer needs CUDA's host registration)
        capturer = BaseTopkCapturer.__new__(BaseTopkCapturer)
        capturer.num_layers, capturer.topk_size = num_layers, top_k
        capturer.device_cache = BaseDeviceCache(rows, num_layers, top_k, "cpu", name="routed_experts")
        capturer.host_cache = SimpleNamespace(buffer=torch.zeros(MAX_CAPTURED_TOKENS, num_layers, top_k,
                                                                 dtype=torch.int32), destroy=lambda: None)
        self.capturer = capturer
        set_global_experts_capturer(capturer)  # what _maybe_collect_routed_experts reads
        self.top_k = top_k
        self.req_to_token_pool = SimpleNamespace(req_to_token=ReqToTokenRows())
        self._free_locations = list(range(MAX_CAPTURED_TOKENS - 1, -1, -1))
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._hooked: torch.nn.Module | None = None
        self._handles: list = []
        self._hook_model(model)

    def _hook_model(self, model: torch.nn.Module) -> None:
        """Hooks on `model`'s routers (a disk update may swap the model object: the new one's)."""
        if model is self._hooked:
            return
        for handle in self._handles:
            handle.remove()
        self._handles = [block.gate.register_forward_hook(self._hook(index))
                         for index, block in moe_blocks(model).items()]
        self._hooked = model

    def _hook(self, layer_id: int):
        def hook(module, inputs, output):
            if isinstance(output, tuple):  # transformers 5 routers: (logits, weights, indices)
                indices = output[2]
            else:  # a plain linear gate: softmax, then top-k (transformers 4's Qwen MoE blocks)
                indices = torch.topk(torch.softmax(output.float(), dim=-1), self.top_k, dim=-1).indices
            self.capturer.capture(layer_id, indices.reshape(-1, self.top_k).to(torch.int32))
        return hook

    def feed(self, model: torch.nn.Module, req, num_tokens: int) -> torch.Tensor:
        """Locations of the next `num_tokens` tokens of `req` fed to `model` (its pool slot on first
        use); returns them as the forward's out_cache_loc."""
        self._hook_model(model)
        if req.kv.req_pool_idx is None:
            req.kv.req_pool_idx = self._free_slots.pop() if self._free_slots else self._next_slot
            self._next_slot = max(self._next_slot, req.kv.req_pool_idx + 1)
            self.req_to_token_pool.req_to_token[req.kv.req_pool_idx] = torch.zeros(0, dtype=torch.int64)
        if num_tokens > len(self._free_locations):
            raise RuntimeError(f"the harness captures routed experts of at most {MAX_CAPTURED_TOKENS} tokens at once")
        locations = torch.tensor([self._free_locations.pop() for _ in range(num_tokens)], dtype=torch.int64)
        rows = self.req_to_token_pool.req_to_token
        rows[req.kv.req_pool_idx] = torch.cat([rows[req.kv.req_pool_idx], locations])
        return locations

    def forward_end(self, locations: torch.Tensor) -> None:
        """SGLang's on_forward_end (the non-overlapped path): the forward's rows to the host buffer."""
        self.capturer.on_forward_end(SimpleNamespace(out_cache_loc=locations, out_cache_loc_virtual=None),
                                     can_run_graph=False, cuda_graph_batch=None)

    def release(self, req) -> None:
        """The request's locations and pool slot go back (SGLang's release_kv_cache)."""
        slot = req.kv.req_pool_idx
        if slot is None:
            return
        self._free_locations.extend(self.req_to_token_pool.req_to_token.pop(slot).tolist())
        self._free_slots.append(slot)
        req.kv.req_pool_idx = None


def moe_blocks(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Layer id -> the HF layer's MoE block (a router `gate` and `experts`)."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    return {i: layer.mlp for i, layer in enumerate(layers)
            if hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "gate")}
