"""A torch.distributed process group of its own, outside the trainer's default group.

Built the way SGLang builds its side in /init_weights_update_group: a TCPStore at
master_address:master_port that rank 0 (the trainer) hosts, keys prefixed with the group name, and
torch's process-group constructor. Both sides must build it the same way for the store keys to
meet. The store is made here rather than by c10d.rendezvous("tcp://..."): under torchrun
(TORCHELASTIC_USE_AGENT_STORE=True) that call makes every rank a client, so nobody would host it.

The host binds its store before it tells the engines the port (host_store(port=0)): a port picked
free and closed again can be taken by another socket before the store binds it, and the engines
would then wait in /init_weights_update_group on someone else's listener."""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def host_store(master_address: str, master_port: int, world_size: int, timeout_s: float = 300.0) -> dist.TCPStore:
    """Rank 0's store, listening before anyone is told where: master_port 0 lets the OS pick a port
    (read it back from .port)."""
    return dist.TCPStore(master_address, master_port, world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s), multi_tenant=master_port != 0)


def init_custom_process_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                              group_name: str, timeout_s: float = 300.0,
                              store: dist.TCPStore | None = None) -> dist.ProcessGroup:
    """`store`: rank 0's store from host_store (else made here, hosted by rank 0)."""
    timeout = timedelta(seconds=timeout_s)
    if store is None:
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
