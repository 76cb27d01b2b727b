"""TensorTransport on a CPU feeds every TP rank of every engine from this process's shared memory.
torch counts the receivers of a shared-memory tensor per pickling ("file_system" sharing: a pickling
adds one reference, each unpickling takes one back), so a payload pickled once and read by a third
process found it unlinked: two real SGLang engines of TP 2 behind one trainer failed at their third
rank ("unable to open shared memory object ... No such file or directory")."""
from __future__ import annotations

import base64
import multiprocessing as mp
import pickle
from concurrent.futures import ProcessPoolExecutor

import torch

from megatron_grpo.rollout.sglang.weight_sync import EngineTarget, TensorTransport


def _unpickle_sum(serialized: str) -> float:
    """What an SGLang scheduler rank does with its payload: unpickle, read, free."""
    return sum(float(tensor.sum()) for _, tensor in pickle.loads(base64.b64decode(serialized)))


class _EngineRanks:
    """An SGLangClient stand-in: each TP rank's payload of /update_weights_from_tensor is unpickled
    in another process (one after another, as SGLang's ranks load and free their copies)."""

    def __init__(self, pool: ProcessPoolExecutor):
        self.pool, self.sums = pool, []

    def call(self, url, path, payload, *, timeout_s=None):
        assert path == "/update_weights_from_tensor"
        for serialized in payload["serialized_named_tensors"]:
            self.sums.append(self.pool.submit(_unpickle_sum, serialized).result())
        return {"success": True}


def test_every_rank_of_every_engine_maps_the_bucket():
    tensors = [("model.norm.weight", torch.arange(6.0)), ("lm_head.weight", torch.ones(3, 2))]
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        client = _EngineRanks(pool)
        transport = TensorTransport(client, [EngineTarget("http://engine-a", 2), EngineTarget("http://engine-b", 2)],
                                    flattened=False)
        stats = transport.push(iter(tensors), version=1)
    assert stats.num_buckets == 1
    assert client.sums == [sum(float(t.sum()) for _, t in tensors)] * 4  # 2 engines x 2 TP ranks
