"""`megatron-grpo train RECIPE [key.sub=value ...]` and `python -m megatron_grpo.train`.

The same program runs as one plain process or under torchrun / srun / mpirun: ranks come from the
launcher's environment (launch/env.py). The recipe is loaded and validated before torch or
megatron-core is imported, so a config error costs a fraction of a second (exit code 2).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="megatron-grpo train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="a YAML recipe file, or a name from recipes/ (e.g. tiny_cpu)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-6 rollout.n=8")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    from megatron_grpo.config import load_config, validate
    from megatron_grpo.config.model_paths import check_model_paths
    from megatron_grpo.launch.env import discover_ranks

    args = parse_args(argv)
    cfg = load_config(args.recipe, args.overrides)
    ranks = discover_ranks(os.environ)
    validate(cfg, world_size=ranks.world_size, ranks_per_node=ranks.local_world_size)
    check_model_paths(cfg)  # a missing local folder is named now, not sent to the hub (config/model_paths.py)
    # Our own INFO lines on rank 0; megatron-core's INFO chatter (bucket listings...) stays hidden.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron_grpo").setLevel(logging.INFO if ranks.rank == 0 else logging.WARNING)
    from megatron_grpo.launch.mcore_compat import quiet_known_notices

    quiet_known_notices()  # before megatron-core is imported: some notices come at import time

    from megatron_grpo.launch.distributed import shutdown
    from megatron_grpo.trainer.console import console_may_be_gone
    from megatron_grpo.trainer.loop import train

    # On every exit path (done, a one-line error, a crash): no gloo worker may still be releasing
    # a collective when the interpreter finalizes (launch/distributed.py, "Exit").
    try:
        out = train(cfg)
    except KeyboardInterrupt:  # Ctrl-C before the steps began (or after they ended): nothing to save
        shutdown(failed=True)
        with console_may_be_gone():
            print("error: interrupted by SIGINT while setting up or shutting down (during the steps a first "
                  "Ctrl-C saves a checkpoint and stops); nothing to save", file=sys.stderr, flush=True)
        return 130
    except BaseException:
        shutdown(failed=True)
        raise
    shutdown()
    if ranks.rank == 0:
        with console_may_be_gone():  # the terminal may have closed (SIGHUP): the run still succeeded
            print(f"done: metrics in {out / 'metrics.jsonl'}", flush=True)
    return 0
