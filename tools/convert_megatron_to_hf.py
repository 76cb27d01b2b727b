#!/usr/bin/env python
"""megatron or training checkpoint (any TP/PP/DP/CP) -> HF folder. See --help; same as
`megatron-grpo convert megatron-to-hf` and `megatron-grpo export`."""
import sys

from megatron_grpo.convert.cli import main

if __name__ == "__main__":
    sys.exit(main(["megatron-to-hf", *sys.argv[1:]]))
