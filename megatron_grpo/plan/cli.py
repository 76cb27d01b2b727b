"""`megatron-grpo plan RECIPE [key.sub=value ...] --nodes N --gpus-per-node G --gpu-memory-gb M`:
every pipeline stage's memory through a GRPO step, simulated with the real model and step code on
fake tensors (no GPU, no weights), the engines' KV capacity and the weight-sync volume. Exit 0
when the layout fits, 2 when it does not (one line says where and what to change) or the recipe
is bad. --trainer-gpus W plans the trainer alone on W GPUs (what `train` does before it builds
anything on a CUDA cluster). Every flag is checked before the recipe is read (cli_args.py)."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from typing import Optional, Sequence

from megatron_grpo.cli_args import (ArgumentParser, flag_error, non_negative_float, output_file, positive_float,
                                    positive_int)
from megatron_grpo.config import load_config, validate


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="megatron-grpo plan", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="a recipe file or name")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")
    parser.add_argument("--nodes", type=positive_int, default=None,
                        help="nodes of the job (trainer and dedicated engines) [1]")
    parser.add_argument("--gpus-per-node", type=positive_int, default=8)
    parser.add_argument("--gpu-memory-gb", type=positive_float, default=80.0,
                        help="GiB per GPU as nvidia-smi shows it [80]")
    parser.add_argument("--reserve-gb", type=non_negative_float, default=3.0,
                        help="GiB per GPU no tensor of the step holds: CUDA context, NCCL, fragmentation [3]")
    parser.add_argument("--link-gbps", type=positive_float, default=400.0, help="network link per GPU, Gb/s [400]")
    parser.add_argument("--trainer-gpus", type=positive_int, default=None,
                        help="plan the trainer alone on this many GPUs (no engines)")
    parser.add_argument("--json", metavar="PATH", type=output_file, default=None,
                        help="also write the figures as JSON")
    return parser


def parse_arguments(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """The flags, each checked alone (their types) and together, before anything is read."""
    args = build_parser().parse_intermixed_args(argv)
    if args.reserve_gb >= args.gpu_memory_gb:
        flag_error("--reserve-gb", f"{args.reserve_gb:g} must be less than --gpu-memory-gb {args.gpu_memory_gb:g}: "
                                   "nothing would be left for the step")
    if args.trainer_gpus is not None and args.nodes is not None:
        flag_error("--trainer-gpus", "and --nodes cannot be given together: --trainer-gpus plans the trainer alone")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megatron_grpo.plan.cluster import Cluster, placement
    from megatron_grpo.plan.recipe_plan import plan_recipe
    from megatron_grpo.plan.report import render
    from megatron_grpo.plan.summary import summary

    args = parse_arguments(argv)
    cfg = load_config(args.recipe, args.overrides)
    if args.trainer_gpus is not None:
        cluster = Cluster(nodes=1, gpus_per_node=args.trainer_gpus, gpu_memory_gb=args.gpu_memory_gb,
                          link_gbps=args.link_gbps, reserve_gb=args.reserve_gb)
        cfg = trainer_only(cfg)
    else:
        cluster = Cluster(nodes=args.nodes or 1, gpus_per_node=args.gpus_per_node, gpu_memory_gb=args.gpu_memory_gb,
                          link_gbps=args.link_gbps, reserve_gb=args.reserve_gb)
    if args.trainer_gpus is None:  # (the trainer calls it after its own checks at its real layout)
        # the trainer's checks at its world size (heads by TP, batches by DP, engines by GPUs, ...)
        validate(cfg, world_size=placement(cfg, cluster).trainer_gpus, ranks_per_node=cluster.gpus_per_node)
    quiet_third_party()
    plan = plan_recipe(cfg, cluster, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(render(plan, args.recipe), end="")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(summary(plan), out, indent=2)
    return 0 if plan.fits else 2


def trainer_only(cfg):
    """The recipe with its engines given by URL: the plan then places nobody but the trainer."""
    import dataclasses

    sglang = dataclasses.replace(cfg.rollout.sglang, urls=cfg.rollout.sglang.urls or ["http://engines:0"])
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, sglang=sglang))


def quiet_third_party() -> None:
    """megatron-core's import-time fallback warnings say nothing about the plan."""
    warnings.filterwarnings("ignore", module="megatron")
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("megatron").setLevel(logging.ERROR)
