"""`python -m megatron_grpo.train RECIPE [overrides]`: the same as `megatron-grpo train`."""
import sys

from megatron_grpo.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
