"""`megatron-grpo` command line: `config ...` here, other subcommands dispatched through COMMANDS.

Project errors (MegatronGRPOError) print as one line `error: ...` on stderr and exit with their
exit_code (2 for config errors), never a traceback. This module and megatron_grpo.config import no
torch / megatron, so a bad recipe fails in well under a second.
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib
import json
import sys
import typing
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Sequence

from megatron_grpo.cli_args import ArgumentParser, positive_int
from megatron_grpo.errors import MegatronGRPOError


@dataclass(frozen=True)
class Command:
    """A subcommand implemented elsewhere: `target` is "module:function", called with the
    remaining argv (list[str]) and returning an exit code (None = 0). Imported only when run."""

    target: str
    help: str


# Add a subcommand by adding a row; its module is imported only when the subcommand runs.
COMMANDS: Mapping[str, Command] = MappingProxyType({
    "train": Command("megatron_grpo.trainer.main:main", "train with GRPO: train RECIPE [key.sub=value ...]"),
    "eval": Command("megatron_grpo.trainer.evaluation.eval_cli:main", "evaluate a checkpoint on the validation set"),
    "convert": Command("megatron_grpo.convert.cli:main", "convert checkpoints between HF and Megatron"),
    "doctor": Command("megatron_grpo.doctor.cli:main",
                      "check this node against a recipe's needs: doctor [RECIPE] [key.sub=value ...]"),
    "plan": Command("megatron_grpo.plan.cli:main",
                    "simulate every rank's memory for a recipe on a cluster: plan RECIPE --nodes N ..."),
    "export": Command("megatron_grpo.convert.export_cli:main",
                      "a training checkpoint -> HF folder: export RUN_DIR|CHECKPOINT_DIR [--step N] --out HF_DIR"),
})


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] in COMMANDS:
        # the subcommand parses its own arguments (--help included): argparse would take them here
        args = argparse.Namespace(run=_dispatcher(argv[0], COMMANDS[argv[0]]), argv=argv[1:])
    elif argv[:2] == ["config", "from-verl"]:
        args = _from_verl_args(argv[2:])  # a verl command line holds flags (-m, --config-name) of its own
    else:
        args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except MegatronGRPOError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # metrics, logs, the initial model: checkpoints report it themselves (and keep the last good one)
        print(f"error: no space left on the device writing {exc.filename or 'a file'} ({exc.strerror}); "
              "free some, or point logging.output_dir / checkpoint.save_dir elsewhere", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="megatron-grpo", description="GRPO on megatron-core.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        plugin = sub.add_parser(name, help=command.help, add_help=False)
        plugin.add_argument("argv", nargs=argparse.REMAINDER)
        plugin.set_defaults(run=_dispatcher(name, command))
    _add_config_parser(sub)
    return parser


def _add_config_parser(sub: argparse._SubParsersAction) -> None:
    config = sub.add_parser("config", help="inspect recipes").add_subparsers(
        dest="config_command", required=True, metavar="ACTION")
    show = config.add_parser("show", help="print the resolved config of RECIPE [overrides] as YAML")
    show.add_argument("recipe", help="a recipe file, or the name of one in recipes/ (e.g. tiny_cpu)")
    show.add_argument("overrides", nargs="*", metavar="key.sub=value")
    show.add_argument("--world-size", type=positive_int, default=None,
                      help="also check the batch sizes and engine placement against this many ranks")
    show.add_argument("--ranks-per-node", type=positive_int, default=None,
                      help="with --world-size: trainer ranks (GPUs) per node, for the colocated placement")
    show.add_argument("--no-validate", action="store_true", help="skip the cross-field checks")
    show.add_argument("--check-data", action="store_true",
                      help="also run the start's data checks (model context, tokenizer, every prompt file read "
                           "and encoded) without building a model")
    show.set_defaults(run=_config_show)
    keys = config.add_parser("keys", help="list every config key with its type and default")
    keys.set_defaults(run=_config_keys)
    _from_verl_parser(config)
    verl_keys = config.add_parser("verl-keys", help="print the verl key table (markdown, as in docs/verl.md)")
    verl_keys.set_defaults(run=_config_verl_keys)


FROM_VERL_HELP = """\
Translates a verl command line or YAML into a recipe here (printed as YAML on stdout; its header
lists what changed and every verl key with no equivalent, with why). The verl arguments are taken
as verl's examples write them: the key=value overrides alone, the whole line
(python3 -m verl.trainer.main_ppo --config-name=... key=value ...), one quoted line with backslash
breaks, a verl YAML file, or a launch script (run.sh [ARGS]: read without running it, the
arguments of the python3 -m verl.trainer.main_ppo it runs, with its variables expanded as bash
would; ARGS are its "$@", the environment fills what it does not set). The recipe is validated
unless --no-validate.
  megatron-grpo config from-verl python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo ... > my.yaml
  megatron-grpo config from-verl examples/grpo_trainer/run_qwen3-8b.sh > my.yaml
  megatron-grpo train my.yaml
"""


def _from_verl_parser(config: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from_verl = config.add_parser("from-verl",
                                  help="translate a verl command line, YAML or launch script into a recipe",
                                  description=FROM_VERL_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    from_verl.add_argument("--no-validate", action="store_true", help="skip the cross-field checks")
    from_verl.add_argument("verl", nargs="+", metavar="VERL_ARG",
                           help="verl's arguments, a verl YAML file, or a launch script and its arguments")
    from_verl.set_defaults(run=_config_from_verl)
    return from_verl


def _from_verl_args(argv: list[str]) -> argparse.Namespace:
    """`config from-verl` arguments: our options first, then verl's, untouched."""
    no_validate = False
    while argv and argv[0] in ("--no-validate", "-h", "--help"):
        if argv[0] != "--no-validate":
            parser = ArgumentParser(prog="megatron-grpo config")
            _from_verl_parser(parser.add_subparsers()).print_help()
            raise SystemExit(0)
        no_validate, argv = True, argv[1:]
    if not argv:
        print("megatron-grpo config from-verl: error: give verl's arguments or a verl YAML file "
              "(see --help)", file=sys.stderr)
        raise SystemExit(2)
    return argparse.Namespace(run=_config_from_verl, verl=argv, no_validate=no_validate)


def _config_from_verl(args: argparse.Namespace) -> int:
    from megatron_grpo.config import validate
    from megatron_grpo.config.from_verl import config_of, read_verl, render_recipe, translate

    translation = translate(read_verl(args.verl))
    sys.stdout.write(render_recipe(translation))
    config = config_of(translation)
    if not args.no_validate:
        validate(config)
    return 0


def _config_verl_keys(args: argparse.Namespace) -> int:
    from megatron_grpo.config.from_verl import markdown_table

    sys.stdout.write(markdown_table())
    return 0


def _config_show(args: argparse.Namespace) -> int:
    from megatron_grpo.config import load_config, to_yaml, validate

    from megatron_grpo.config.derived import implied_settings
    from megatron_grpo.config.validate import config_warnings

    config = load_config(args.recipe, args.overrides)
    if not args.no_validate:
        validate(config, world_size=args.world_size, ranks_per_node=args.ranks_per_node)
        sys.stderr.write("".join(f"warning: {line}\n" for line in config_warnings(config)))
    sys.stdout.write("".join(f"# implied: {line}\n" for line in implied_settings(config)))
    if args.check_data:  # the trainer's own checks, imported only when asked for (as subcommands are)
        check_data = import_target("megatron_grpo.trainer.assembly.data_check:check_data")
        sys.stdout.write("".join(f"# data: {line}\n" for line in check_data(config)))
    sys.stdout.write(to_yaml(config))
    return 0


def _config_keys(args: argparse.Namespace) -> int:
    from megatron_grpo.config.coerce import describe, field_types, one_or_more_fields
    from megatron_grpo.config.schema import Config

    def walk(cls: type, prefix: str) -> None:
        defaults = cls()
        one_or_more = one_or_more_fields(cls)
        for name, tp in field_types(cls).items():
            value = getattr(defaults, name)
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{name}.")
            else:
                kind = f"a str or {describe(tp)}" if name in one_or_more else describe(tp)
                print(f"{prefix}{name}\t{kind}\t{json.dumps(value)}")
                item = typing.get_args(tp)[1] if typing.get_origin(tp) is dict else None
                if dataclasses.is_dataclass(item):  # named sections (reward.models.<name>.*)
                    walk(item, f"{prefix}{name}.<name>.")

    walk(Config, "")
    return 0


def _dispatcher(name: str, command: Command) -> Callable[[argparse.Namespace], Optional[int]]:
    def run(args: argparse.Namespace) -> Optional[int]:
        return load_command(name, command)(list(args.argv))

    return run


def load_command(name: str, command: Command) -> Callable[[list[str]], Optional[int]]:
    """Imports the subcommand's function (tests/test_cli.py checks every target resolves); an
    import error inside its module propagates (a real bug or a missing dependency)."""
    return import_target(command.target)


def import_target(target: str) -> Callable:
    """"package.module:function", imported now."""
    module_name, _, function_name = target.partition(":")
    return getattr(importlib.import_module(module_name), function_name)


if __name__ == "__main__":
    sys.exit(main())
