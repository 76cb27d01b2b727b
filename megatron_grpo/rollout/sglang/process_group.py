"""A torch.distributed process group of its own, outside the trainer's default group.

Built the way SGLang builds its side in /init_weights_update_group: a TCPStore at
master_address:master_port that rank 0 (the trainer) hosts, keys prefixed with the group name, and
torch's process-group constructor. Both sides must build it the same way for the store keys to
meet. The store is made here rather than by c10d.rendezvous("tcp://..."): under torchrun
(TORCHELASTIC_USE_AGENT_STORE=True) that call makes every rank a client, so nobody would host it."""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def init_custom_process_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                              group_name: str, timeout_s: float = 300.0) -> dist.ProcessGroup:
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                          multi_tenant=True)
    store = c10d.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                              group_name=group_name, backend_options=None, timeout=timeout)
    # Group ranks are the ranks given here (not ranks of a default group), as SGLang assumes.
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_process_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)
