"""`megatron-grpo export RUN_DIR|CHECKPOINT_DIR [--step N] --out HF_DIR`: a training checkpoint
(or a hf-to-megatron one) -> an HF model folder that `transformers` loads.

The same as `megatron-grpo convert megatron-to-hf --ckpt ...`; one process is enough for any
checkpoint (whatever TP / PP / DP / CP saved it), torchrun with --tp / --pp splits the load.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from megatron_grpo.cli_args import ArgumentParser
from megatron_grpo.convert.cli import CHECKPOINT_HELP, add_export_arguments, megatron_to_hf, run_tool

EPILOG = """examples:
  megatron-grpo export outputs/tiny_cpu --out exported/tiny            # newest complete step
  megatron-grpo export outputs/tiny_cpu --step 50 --out exported/step50
  megatron-grpo export outputs/run1/checkpoints/step_100 --out /export/step100 --max-shard-size 2GB
  torchrun --nproc-per-node 8 -m megatron_grpo.cli export /ckpt/run1 --out /export/run1 --tp 4 --pp 2

  megatron-grpo export outputs/tiny_cpu_lora --out exported/adapter   # a LoRA run: a PEFT adapter folder
  megatron-grpo export outputs/tiny_cpu_lora --merged --out exported/merged

writes: model.safetensors (or model-0000k-of-0000n.safetensors + index), config.json, the
tokenizer files and generation_config.json of the model the run started from; for a LoRA run
adapter_config.json + adapter_model.safetensors (peft's PeftModel.from_pretrained(base, DIR)),
or with --merged the HF model with the adapters folded in.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="megatron-grpo export", description=__doc__.splitlines()[0],
                            epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpt", type=Path, metavar="RUN_DIR|CHECKPOINT_DIR", help=CHECKPOINT_HELP)
    add_export_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_tool(megatron_to_hf, build_parser().parse_args(argv))
