"""torch DCP reads the non-tensor entries of a checkpoint (megatron's optimizer step counts, param
groups, sharding metadata) with torch.load(weights_only=False), which unpickles arbitrary objects.

`dcp_bytes_weights_only()` switches DefaultLoadPlanner.load_bytes (which megatron's MCoreLoadPlanner
inherits; megatron builds the planner inside its load strategy, so no planner of ours can be passed
in) to torch.load(weights_only=True) for the duration of a with-block, and restores it after. The
replacement is torch's own load_bytes (torch 2.6-2.14) with that one argument changed.
"""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def dcp_bytes_weights_only():
    from torch.distributed.checkpoint import default_planner

    original = default_planner.DefaultLoadPlanner.load_bytes

    def load_bytes(self, read_item, value):
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            default_planner.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

    default_planner.DefaultLoadPlanner.load_bytes = load_bytes
    try:
        yield
    finally:
        default_planner.DefaultLoadPlanner.load_bytes = original
