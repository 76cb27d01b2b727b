#!/usr/bin/env python
"""megatron checkpoint (any TP/PP) -> HF folder. See --help; same as `megatron-grpo convert megatron-to-hf`."""
import sys

from megatron_grpo.convert.cli import main

if __name__ == "__main__":
    sys.exit(main(["megatron-to-hf", *sys.argv[1:]]))
