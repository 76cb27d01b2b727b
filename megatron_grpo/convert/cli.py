"""`megatron-grpo convert hf-to-megatron|megatron-to-hf ...` (also tools/convert_*.py).

Runs as one process or under torchrun / srun (one rank per TP x PP shard; more ranks = data
parallel copies, harmless). A single process converts at TP=1, PP=1: the checkpoint it writes is
layout-free and loads at any TP/PP; only the vocabulary padding depends on the target TP
(--tp), and it is fixed in the checkpoint. megatron-to-hf also reads training checkpoints (a
run folder, its checkpoints/, step_N/ or step_N/model_optim/; see convert/sources.py), saved at
any TP / PP / DP / CP, loading only the model part.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from megatron_grpo.cli_args import ArgumentParser, byte_size, output_folder, positive_int
from megatron_grpo.errors import CheckpointError, ConfigError, MegatronGRPOError

EPILOG_HF_TO_MEGATRON = """examples:
  # one process; vocabulary padded for TP=8
  megatron-grpo convert hf-to-megatron --hf /models/Qwen3-8B --out /ckpt/qwen3-8b-mcore --tp 8
  # 4 processes, each loading only its shard
  torchrun --nproc-per-node 4 tools/convert_hf_to_megatron.py --hf /models/Llama-3.1-8B \\
      --out /ckpt/llama31-8b --tp 2 --pp 2
  # a MoE model, experts spread over 8 ranks (the checkpoint still loads at any TP / PP / EP)
  torchrun --nproc-per-node 8 tools/convert_hf_to_megatron.py --hf /models/Qwen3-30B-A3B \\
      --out /ckpt/qwen3-30b-a3b --ep 8
"""
EPILOG_MEGATRON_TO_HF = """examples:
  megatron-grpo convert megatron-to-hf --ckpt /ckpt/qwen3-8b-mcore --out /export/qwen3-8b-hf
  # a training run: its newest complete checkpoint, or --step N (same as `megatron-grpo export`)
  megatron-grpo convert megatron-to-hf --ckpt outputs/run1 --step 100 --out /export/step100
  megatron-grpo convert megatron-to-hf --ckpt outputs/run1/checkpoints/step_100 --out /export/step100
  # check against (and take tokenizer files from) the original HF folder
  megatron-grpo convert megatron-to-hf --ckpt /ckpt/qwen3-8b-mcore --out /export/qwen3-8b-hf \\
      --hf-reference /models/Qwen3-8B --force
"""
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="megatron-grpo convert",
                            description="Convert between HF safetensors folders and megatron checkpoints.")
    sub = parser.add_subparsers(dest="direction", required=True)
    h2m = sub.add_parser("hf-to-megatron", help="HF folder -> megatron dist_checkpoint (torch_dist)",
                         epilog=EPILOG_HF_TO_MEGATRON, formatter_class=argparse.RawDescriptionHelpFormatter)
    h2m.add_argument("--hf", required=True, type=Path, help="HF model folder (config.json + *.safetensors)")
    h2m.add_argument("--out", required=True, type=output_folder, help="output checkpoint folder")
    h2m.add_argument("--tp", type=positive_int, default=1, help="target tensor parallel size (vocab padding, and "
                                                                "the sharding used when run under torchrun)")
    h2m.add_argument("--pp", type=positive_int, default=1, help="pipeline parallel size when run under torchrun")
    _add_expert_arguments(h2m)
    h2m.add_argument("--vocab-multiple", type=positive_int, default=128,
                     help="pad the vocabulary to a multiple of this times --tp (default 128)")
    h2m.add_argument("--dtype", choices=["auto", *_DTYPES], default="auto",
                     help="stored dtype; auto = config.json's dtype (bf16 or fp32)")
    h2m.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    m2h = sub.add_parser("megatron-to-hf", help="megatron or training checkpoint (any TP/PP) -> HF folder",
                         epilog=EPILOG_MEGATRON_TO_HF, formatter_class=argparse.RawDescriptionHelpFormatter)
    m2h.add_argument("--ckpt", required=True, type=Path, help=CHECKPOINT_HELP)
    add_export_arguments(m2h)
    return parser


CHECKPOINT_HELP = ("a hf-to-megatron checkpoint (or its model/), a training run folder, its checkpoints/, "
                   "a step_N folder or its model_optim/")


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """The options `convert megatron-to-hf` and `export` share."""
    parser.add_argument("--step", type=positive_int, default=None,
                        help="training step to export from a run / checkpoints folder (default: the newest "
                             "complete one)")
    parser.add_argument("--out", required=True, type=output_folder, help="output HF folder")
    parser.add_argument("--hf-reference", type=Path, default=None,
                        help="HF folder whose config.json and tokenizer files are used (a hf-to-megatron "
                             "checkpoint's config must match it)")
    parser.add_argument("--tp", type=positive_int, default=1, help="TP size to load with under torchrun")
    parser.add_argument("--pp", type=positive_int, default=1, help="PP size to load with under torchrun")
    _add_expert_arguments(parser)
    parser.add_argument("--max-shard-size", type=byte_size, default="5GB",
                        help="safetensors shard size, e.g. 5GB, 500MB")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    parser.add_argument("--merged", action="store_true",
                        help="a LoRA run: the HF model with the adapters merged in (default: a PEFT adapter folder)")


def _add_expert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ep", type=positive_int, default=1,
                        help="expert parallel size under torchrun (MoE models: experts spread over EP ranks)")
    parser.add_argument("--etp", type=positive_int, default=None,
                        help="expert tensor parallel size under torchrun (default: --tp)")


def check_expert_layout(cfg, args, where: str) -> None:
    """--ep / --etp split the model's experts (one ConfigError naming the option otherwise)."""
    etp = args.tp if args.etp is None else args.etp
    try:
        cfg.check_expert_parallel(args.ep, etp)
    except ConfigError as exc:
        raise ConfigError(f"--ep {args.ep} / --etp {etp}: {where}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.direction == "hf-to-megatron":
        return run_tool(hf_to_megatron, args)
    return run_tool(megatron_to_hf, args)


def run_tool(function, args) -> int:
    """Runs a conversion; a project error is one `error:` line on stderr and its exit code."""
    from megatron_grpo.launch.mcore_compat import quiet_known_notices

    quiet_known_notices()  # megatron-core's notices would bury the one line that matters
    try:
        function(args)
    except MegatronGRPOError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


def _check_output(out: Path, force: bool) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise CheckpointError(f"{out}: output exists and is not empty (use --force to overwrite)")


def refuse_output_over_sources(out: Path, sources: list[tuple[str, Path | None]]) -> None:
    """--out may neither be, lie inside nor hold a folder the conversion reads: the output is
    assembled beside it and renamed into place, replacing whatever --out held (--force), so it
    would delete the checkpoint (or its run) while it is read. ConfigError (exit 2) naming both
    paths, also with --force. `sources`: (what, folder) pairs."""
    target = _absolute(out)
    for what, folder in sources:
        if folder is None:
            continue
        source = _absolute(folder)
        if target == source:
            relation = "is"
        elif source in target.parents:
            relation = "lies inside"
        elif target in source.parents:
            relation = "holds"
        else:
            continue
        raise ConfigError(f"--out {out} {relation} {what} {folder}, which this command reads (the output "
                          f"replaces --out's folder, even with --force): choose an --out outside it")


def _absolute(path: Path) -> Path:
    return Path(path).expanduser().resolve()


def folders_read(ckpt: Path) -> list[tuple[str, Path]]:
    """The folders `export` / `megatron-to-hf` read for the path a user gave (by name, before it is
    resolved, so the check needs no complete checkpoint): the path, and for a training checkpoint
    its checkpoints folder and its run folder."""
    from megatron_grpo.checkpointing.layout import MODEL_OPTIM_DIR, STEP_DIR

    path = _absolute(ckpt)
    step = None
    if path.name == MODEL_OPTIM_DIR and STEP_DIR.match(path.parent.name):
        step = path.parent
    elif STEP_DIR.match(path.name):
        step = path
    found = [("the source", ckpt)]
    if step is not None:
        found.append(("the checkpoints folder", step.parent))
        if step.parent.name == "checkpoints":
            found.append(("the run folder", step.parent.parent))
    elif path.name == "checkpoints":
        found.append(("the run folder", path.parent))
    return found


class _Distributed:
    """torch.distributed for the tool: torchrun's / srun's / mpirun's ranks when present, else one
    process (launch.init_distributed: port 0, no race for a free port); ends through
    launch.distributed.shutdown, which also waits for gloo's workers (no abort at exit)."""

    def __enter__(self):
        import torch.distributed as dist

        from megatron_grpo.launch.distributed import init_distributed

        self.owned = not dist.is_initialized()
        if self.owned:
            init_distributed()
        return dist

    def __exit__(self, exc_type, *exc):
        from megatron.core import parallel_state

        from megatron_grpo.launch.distributed import shutdown

        if self.owned:
            shutdown(failed=exc_type is not None)
        elif parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()


def _layout_for(dist, tp: int, pp: int, ep: int = 1, etp: int | None = None):
    from megatron_grpo.launch.parallel import ParallelLayout

    world = dist.get_world_size()
    if world == 1:
        return ParallelLayout()
    if world % (tp * pp):
        raise CheckpointError(f"world size {world} is not a multiple of --tp {tp} x --pp {pp}")
    expert_ranks = ep * (tp if etp is None else etp) * pp
    if world % expert_ranks:
        raise CheckpointError(f"world size {world} is not a multiple of --ep {ep} x --etp {tp if etp is None else etp} "
                              f"x --pp {pp}")
    # Conversion runs no forward, and sequence parallelism changes no weight or checkpoint key; it is
    # on at TP > 1 because megatron-core's MoE layer refuses TP without it (models/builder.py).
    return ParallelLayout(tensor=tp, pipeline=pp, expert=ep, expert_tensor=etp, sequence_parallel=tp > 1)


def hf_to_megatron(args) -> Path:
    from megatron_grpo.convert.loader import load_hf_weights
    from megatron_grpo.convert.megatron_checkpoint import save_megatron_checkpoint
    from megatron_grpo.convert.to_hf import check_layout_fits
    from megatron_grpo.convert.writer import hf_config_dtype
    from megatron_grpo.launch.parallel import initialize_model_parallel
    from megatron_grpo.models import ModelArchitecture, build_model

    refuse_output_over_sources(args.out, [("--hf", args.hf)])
    _check_output(args.out, args.force)
    cfg = ModelArchitecture.from_hf(args.hf, tensor_parallel=args.tp, vocab_multiple=args.vocab_multiple)
    check_layout_fits(cfg, args.tp, args.pp, f"{args.hf}/config.json")
    check_expert_layout(cfg, args, f"{args.hf}/config.json")
    dtype = _DTYPES[args.dtype] if args.dtype != "auto" else (hf_config_dtype(cfg) or torch.float32)
    if dtype not in _DTYPES.values():
        raise CheckpointError(f"{args.hf}/config.json: dtype {dtype} cannot be stored; pass --dtype fp32 or bf16")
    with _Distributed() as dist:
        layout = _layout_for(dist, args.tp, args.pp, args.ep, args.etp)
        initialize_model_parallel(layout)
        chunks = build_model(cfg, layout, dtype=dtype)
        load_hf_weights(chunks, cfg, args.hf, progress=dist.get_rank() == 0)
        out = save_megatron_checkpoint(chunks, cfg, args.out, assets_from=args.hf, overwrite=args.force)
        if dist.get_rank() == 0:
            print(f"wrote {out} ({cfg.architecture}, {cfg.num_layers} layers, vocab {cfg.vocab_size} padded to "
                  f"{cfg.padded_vocab_size}, {str(dtype).removeprefix('torch.')})")
    return out


def megatron_to_hf(args) -> Path:
    """`convert megatron-to-hf --ckpt PATH` and `export PATH`: any checkpoint sources.resolve_source
    accepts, loaded at --tp x --pp under torchrun (TP=PP=1 in one process)."""
    from megatron_grpo.convert.loader import check_hf_config_matches
    from megatron_grpo.convert.sources import resolve_source
    from megatron_grpo.convert.to_hf import check_layout_fits, export_checkpoint_to_hf
    from megatron_grpo.launch.parallel import initialize_model_parallel

    refuse_output_over_sources(args.out, [*folders_read(args.ckpt), ("--hf-reference", args.hf_reference)])
    _check_output(args.out, args.force)
    max_shard_bytes = args.max_shard_size  # (bytes: cli_args.byte_size, the default "5GB" too)
    source = resolve_source(args.ckpt, step=args.step, hf_reference=args.hf_reference)
    # what resolving found: the step folder, and the model folder config.json and the tokenizer come from
    refuse_output_over_sources(args.out, [("the checkpoint", Path(source.label)),
                                          ("the model folder", source.assets_dir)])
    if args.hf_reference is not None and source.step is None:
        check_hf_config_matches(source.model_config, args.hf_reference)
    check_layout_fits(source.model_config, args.tp, args.pp, source.label)
    if args.merged and source.lora is None:
        raise ConfigError(f"--merged: {source.label} is not a LoRA run (its config has no model.lora.rank)")
    check_expert_layout(source.model_config, args, source.label)
    with _Distributed() as dist:
        layout = _layout_for(dist, args.tp, args.pp, args.ep, args.etp)
        initialize_model_parallel(layout)
        export_checkpoint_to_hf(source, args.out, layout=layout, max_shard_bytes=max_shard_bytes,
                                overwrite=args.force, assets_dir=args.hf_reference,
                                progress=dist.get_rank() == 0, merged=args.merged)
        if dist.get_rank() == 0:
            what = f"step {source.step} of {source.label}" if source.step is not None else source.label
            print(f"wrote {args.out} (from {what})")
    return args.out
