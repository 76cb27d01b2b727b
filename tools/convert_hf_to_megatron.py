#!/usr/bin/env python
"""HF folder -> megatron dist_checkpoint. See --help; same as `megatron-grpo convert hf-to-megatron`."""
import sys

from megatron_grpo.convert.cli import main

if __name__ == "__main__":
    sys.exit(main(["hf-to-megatron", *sys.argv[1:]]))
