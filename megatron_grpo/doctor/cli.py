"""`megatron-grpo doctor [RECIPE] [key.sub=value ...]`: the table of what the recipe needs against
what this node has; exit 1 when anything blocks the run, 2 for a bad recipe. Without a recipe,
the environment alone (as the embedded default recipe, tiny_cpu, would need it).

The sbatch scripts run it on every node (`srun --ntasks-per-node=1`) with the job's layout
(--world-size, --ranks-per-node) and the engines' ports (--port) before anything starts.

With --mismatch (and no blocker) it then builds the recipe's run and runs the engine-trainer
preflight (trainer/preflight.py: rounds at learning rate 0, a weight round trip, the trainer and the
engine against themselves) and prints its table; exit 1 when a figure exceeds its bound. Run it as
the trainer runs (one process, or under torchrun / srun with the recipe's layout)."""
from __future__ import annotations

import argparse
import importlib
import socket
from typing import Optional, Sequence

from megatron_grpo.cli_args import ArgumentParser, port, positive_int
from megatron_grpo.config import load_config
from megatron_grpo.doctor.needs import Placement, check_recipe
from megatron_grpo.doctor.report import blockers, render_table

DEFAULT_RECIPE = "tiny_cpu"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="megatron-grpo doctor", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", default=DEFAULT_RECIPE, help="a recipe file or name [tiny_cpu]")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")
    parser.add_argument("--world-size", type=positive_int, default=None, help="trainer ranks of the whole job")
    parser.add_argument("--ranks-per-node", type=positive_int, default=None, help="trainer ranks (GPUs) on each node")
    parser.add_argument("--port", type=port, action="append", dest="ports", default=None,
                        help="a server port that must be free on this node (repeat; default: the recipe's "
                             "when the trainer starts the engines)")
    parser.add_argument("--bind-host", default=None, help="the address those servers bind [rollout.sglang.host]")
    parser.add_argument("--starts-engines", action="store_true",
                        help="the job starts SGLang servers on its nodes (the sbatch scripts), even where the "
                             "recipe gives their URLs")
    parser.add_argument("--mismatch", action="store_true",
                        help="then build the run and check the engine against the trainer (the preflight)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_intermixed_args(argv)  # options may come between the overrides
    config = load_config(args.recipe, args.overrides)
    placement = Placement(world_size=args.world_size, ranks_per_node=args.ranks_per_node,
                          ports=tuple(args.ports) if args.ports is not None else None, bind_host=args.bind_host,
                          starts_engines=args.starts_engines)
    findings = check_recipe(config, placement)
    print(render_table(findings, f"megatron-grpo doctor: recipe {args.recipe} on {socket.gethostname()}"), end="")
    if blockers(findings):
        return 1
    if args.mismatch:
        # the trainer's code, imported only when asked (this package stays light: config and errors)
        preflight_only = importlib.import_module("megatron_grpo.trainer.preflight").preflight_only
        return preflight_only(config)
    return 0
