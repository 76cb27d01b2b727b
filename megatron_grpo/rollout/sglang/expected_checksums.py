"""What SGLang's `/weights_checker {"action": "checksum"}` must report once an engine loaded the
trainer's HF-named tensors, so that every sync can be checked against the trainer itself, even with
one engine (SGLang 0.5.23's Qwen2/Qwen3 have no /get_weights_by_name).

SGLang serves the dense models (Qwen2, Qwen3, Llama) from fused, tensor-parallel-sharded parameters
and hashes those (srt/utils/weight_checker.py: every parameter, by name, on every TP rank). Which
parameter an HF tensor lands in: convert/sglang_params.py. Its weight loaders (srt/layers/linear.py,
vocab_parallel_embedding.py) put on TP rank r of tp:
- `qkv_proj` = cat(q, k, v) along dim 0 (QKVParallelLinear): q's r-th slice of heads; k's and v's
  r-th slice, or on a GPU with fewer kv heads than tp (each kv head on tp / kv_heads ranks) slice
  r // (tp / kv_heads); weight and bias alike;
- `gate_up_proj` = cat(gate, up) along dim 0 (MergedColumnParallelLinear): the r-th slice of each;
- `o_proj`, `down_proj` (RowParallelLinear): the r-th slice of the columns (dim 1);
- `embed_tokens`, `lm_head` (VocabParallelEmbedding): the rows zero-padded to a multiple of 64
  (64 * tp if that is not divisible by tp), the r-th slice of them; a tied lm_head is embed_tokens
  (one parameter);
- everything else (norms, q_norm / k_norm) whole.
Each is held in the engine's dtype (its loaders `copy_` into it: round to nearest even, as `.to`).
The hash is the device's: on CPU the first 8 bytes of sha256 of the bytes (srt/managers/mm_utils.py
tensor_hash), on a GPU SGLang's Triton tile hash (kernels/ops/memory/gpu_tensor_hash.py), computed
here with torch integer ops on the tensor's own device (the same function: tests compare it with
SGLang's kernel run by Triton's interpreter).

What this cannot predict, `ModelLayout.of` / `EngineLayout.of` / `ModelLayout.problem` say why (MoE
fused experts, MLA, quantized or dtype=auto engines, TP splits SGLang pads: on a CPU it pads kv
heads instead of replicating them); verify.py then compares the engines with each other instead.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from megatron_grpo.convert.sglang_params import fused_parts, sglang_parameter

# model_type -> SGLang's class for it; these three fuse q/k/v and gate/up the same way
FUSED_DENSE = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
VOCAB_PADDING = 64  # vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelLayout:
    """The shapes that fix how SGLang fuses and shards the model's tensors."""

    hf_class: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied: bool

    @classmethod
    def of(cls, model) -> "ModelLayout | str":
        """From a models.hf_config.ModelArchitecture; a string says why it cannot be predicted."""
        if model.architecture not in FUSED_DENSE or model.is_moe or model.is_mla:
            return (f"model_type {model.architecture!r}: SGLang's parameter layout for it (fused experts, latent "
                    f"attention) is not predicted, only {', '.join(sorted(FUSED_DENSE))}")
        return cls(FUSED_DENSE[model.architecture], model.num_attention_heads, model.num_query_groups,
                   model.head_dim, model.ffn_hidden_size, model.vocab_size, model.tie_word_embeddings)

    def problem(self, engine: "EngineLayout") -> str | None:
        """Why this engine's layout is not predicted, or None. On a CPU SGLang pads what does not
        split evenly (configs/update_config.py adjust_config_with_unaligned_cpu_tp: kv heads to a
        multiple of tp, and the attention heads with them, instead of replicating kv heads; the
        intermediate size to a multiple of 32 * tp); on a GPU it replicates kv heads and refuses
        other uneven splits."""
        tp = engine.tp_size
        if engine.device == "cpu":
            uneven = self.num_heads % tp or self.num_kv_heads % tp or self.intermediate_size % (32 * tp)
        else:
            kv_uneven = tp % self.num_kv_heads if tp >= self.num_kv_heads else self.num_kv_heads % tp
            uneven = self.num_heads % tp or self.intermediate_size % tp or kv_uneven
        if uneven:
            return (f"{self.num_heads} heads / {self.num_kv_heads} kv heads / intermediate size "
                    f"{self.intermediate_size} at tp_size {tp} on {engine.device}: SGLang pads such splits")
        return None

    def padded_vocab(self, tp_size: int) -> int:
        pad = VOCAB_PADDING
        if _round_up(self.vocab_size, pad) % tp_size:
            pad *= tp_size
        return _round_up(self.vocab_size, pad)


@dataclass(frozen=True)
class EngineLayout:
    """What fixes an engine's checksums besides the model: its TP size, dtype and hash."""

    tp_size: int
    dtype: str  # a DTYPES key
    device: str  # "cpu" or "cuda"

    @property
    def hashing(self) -> str:
        """"sha256" on a CPU, "tiles" on a GPU (SGLang's Triton hash)."""
        return "sha256" if self.device == "cpu" else "tiles"

    @classmethod
    def of(cls, server_info: dict) -> "EngineLayout | str":
        """From an engine's /server_info (its ServerArgs); a string says why it cannot be predicted."""
        dtype, device = server_info.get("dtype"), server_info.get("device")
        reasons = []
        if dtype not in DTYPES:
            reasons.append(f"--dtype {dtype} (the held dtype is not known here; the trainer launches with an "
                           f"explicit one)")
        if device not in ("cpu", "cuda"):
            reasons.append(f"--device {device}")
        for flag in ("quantization", "enable_dp_attention", "enable_dp_lm_head"):
            if server_info.get(flag):
                reasons.append(f"--{flag.replace('_', '-')} {server_info[flag]}")
        if int(server_info.get("pp_size") or 1) > 1 or int(server_info.get("dp_size") or 1) > 1:
            reasons.append("pp_size / dp_size > 1")
        if reasons:
            return "the engine runs with " + ", ".join(reasons)
        return cls(int(server_info.get("tp_size") or 1), dtype, device)


@dataclass
class ChecksumPrediction:
    """Fed the pushed HF tensors (`tap`), it keeps per engine layout and TP rank the checksum each
    SGLang parameter must have. Picklable: per-stage senders fill their own and rank 0 merges them."""

    model: ModelLayout
    layouts: tuple[EngineLayout, ...]
    checksums: dict[EngineLayout, list[dict[str, str]]] = field(default_factory=dict)
    # fused parameters with parts still to come: param -> part -> layout -> that part of each rank
    pending: dict[str, dict[str, dict[EngineLayout, list[torch.Tensor]]]] = field(default_factory=dict)

    def __post_init__(self):
        for layout in self.layouts:
            self.checksums.setdefault(layout, [{} for _ in range(layout.tp_size)])

    def tap(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            self.add(name, tensor)
            yield name, tensor

    def add(self, name: str, tensor: torch.Tensor) -> None:
        param = sglang_parameter(name, self.model.tied)
        if param is None:
            return  # the engine holds it as another parameter (a tied lm_head: embed_tokens)
        tensor = tensor.detach()
        if param.part is None:
            for layout in self.layouts:
                for rank, shard in enumerate(self._shards(param.split, tensor, layout)):
                    self.checksums[layout][rank][param.name] = checksum(shard, layout.hashing)
            return
        parts = self.pending.setdefault(param.name, {})
        parts[param.part] = {layout: [self._fused_part(param.part, tensor, layout, rank)
                                      for rank in range(layout.tp_size)] for layout in self.layouts}
        self._complete(param.name, param.parts)

    def merge(self, other: "ChecksumPrediction") -> None:
        """Adds another sender's prediction (another pipeline stage's tensors)."""
        for layout, ranks in other.checksums.items():
            for mine, theirs in zip(self.checksums.setdefault(layout, [{} for _ in ranks]), ranks):
                mine.update(theirs)
        for param, parts in other.pending.items():
            self.pending.setdefault(param, {}).update(parts)
            self._complete(param, fused_parts(param))

    def expected(self, layout: EngineLayout) -> list[dict[str, str]]:
        """Per TP rank, the checksum of each parameter SGLang holds from the tensors seen; a fused
        parameter some of whose parts never came is absent (the engine's would then be unexpected)."""
        return self.checksums[layout]

    def _complete(self, param: str, order: tuple[str, ...]) -> None:
        parts = self.pending[param]
        if not all(p in parts for p in order):
            return
        del self.pending[param]
        for layout in self.layouts:
            for rank in range(layout.tp_size):
                shard = torch.cat([parts[p][layout][rank] for p in order])
                self.checksums[layout][rank][param] = checksum(shard, layout.hashing)

    def _shards(self, split: str, tensor: torch.Tensor, layout: EngineLayout) -> list[torch.Tensor]:
        tp, tensor = layout.tp_size, tensor.to(DTYPES[layout.dtype])
        if split == "row":
            return list(tensor.chunk(tp, dim=1)) if tp > 1 else [tensor]
        if split == "vocab":
            rows = self.model.padded_vocab(tp)
            if rows != tensor.shape[0]:
                padded = tensor.new_zeros((rows, *tensor.shape[1:]))
                padded[: tensor.shape[0]] = tensor
                tensor = padded
            return list(tensor.chunk(tp, dim=0))
        return [tensor] * tp

    def _fused_part(self, part: str, tensor: torch.Tensor, layout: EngineLayout, rank: int) -> torch.Tensor:
        """TP rank `rank`'s rows of one part of a fused parameter, in the engine's dtype (a copy)."""
        tp, m = layout.tp_size, self.model
        if part in ("q", "gate", "up"):
            index, count = rank, tp
        elif tp >= m.num_kv_heads:  # each kv head on tp / kv_heads ranks
            index, count = rank // (tp // m.num_kv_heads), m.num_kv_heads
        else:
            index, count = rank, tp
        rows = tensor.shape[0] // count
        return tensor.narrow(0, index * rows, rows).to(DTYPES[layout.dtype], copy=True)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


# ----- the hashes -----------------------------------------------------------------------------------
def checksum(tensor: torch.Tensor, hashing: str) -> str:
    """SGLang's checksum string (`f"{tensor_hash(t):016x}"`) of a tensor held on a CPU ("sha256")
    or a GPU ("tiles")."""
    return f"{(sha256_hash if hashing == 'sha256' else tile_hash)(tensor):016x}"


def sha256_hash(tensor: torch.Tensor) -> int:
    """mm_utils.tensor_hash of a CPU tensor: the first 8 bytes of sha256 of its bytes, big-endian."""
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return int.from_bytes(hashlib.sha256(memoryview(data)).digest()[:8], "big")


_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_SEED = 0x243F6A88  # gpu_tensor_hash's defaults: seed, tile_words
_TILE = 8192
_CHUNK_WORDS = 512 * _TILE  # words per pass: bounds the int64 temporaries (~32 MB each)


def tile_hash(tensor: torch.Tensor) -> int:
    """SGLang's gpu_tensor_hash: the bytes as little-endian uint32 words; per tile of 8192 words two
    sums of fmix32(word ^ a position mix), each xor the byte count and fmix32'd, packed into 64 bits;
    the tiles' values summed mod 2^64 and splitmix64'd. uint32 arithmetic in int64 (products split
    in 16-bit halves, so nothing overflows)."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = -data.numel() % 4
    if pad or data.data_ptr() % 4:
        data = torch.cat([data, data.new_zeros(pad)])
    words = data.view(torch.int32)
    n = words.numel()
    if n == 0:
        return 0
    seed1, seed2 = _SEED & _M32, ((_SEED * 0x9E3779B1) ^ 0xDEADBEEF) & _M32
    nbytes = (n * 4) & _M32
    total = 0
    for start in range(0, n, _CHUNK_WORDS):
        word = words[start:start + _CHUNK_WORDS].to(torch.int64) & _M32
        idx = torch.arange(start, start + word.numel(), dtype=torch.int64, device=word.device)
        sums = []
        for mult, seed, rot in ((0x27D4EB2D, seed1, 15), (0x165667B1, seed2, 13)):
            pos = ((_mul32(idx, mult) + seed) & _M32) ^ _rotl32(idx, rot)
            k = _fmix32(word ^ pos)
            k = torch.nn.functional.pad(k, (0, -k.numel() % _TILE)).view(-1, _TILE).sum(dim=1) & _M32
            sums.append(_fmix32(k ^ nbytes).tolist())
        for h1, h2 in zip(*sums):
            total = (total + ((h1 << 32) | h2)) & _M64
    return _splitmix64(total)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _splitmix64(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)
