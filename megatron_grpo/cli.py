"""`megatron-grpo` command line: `config ...` here, other subcommands dispatched through COMMANDS.

Project errors (MegatronGRPOError) print as one line `error: ...` on stderr and exit with their
exit_code (2 for config errors), never a traceback. This module and megatron_grpo.config import no
torch / megatron, so a bad recipe fails in well under a second.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Sequence

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
    "eval": Command("megatron_grpo.trainer.evaluate:main", "evaluate a checkpoint on the validation set"),
    "convert": Command("megatron_grpo.convert.cli:main", "convert checkpoints between HF and Megatron"),
    "export": Command("megatron_grpo.convert.export_cli:main",
                      "a training checkpoint -> HF folder: export RUN_DIR|CHECKPOINT_DIR [--step N] --out HF_DIR"),
})


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except MegatronGRPOError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-grpo", description="GRPO on megatron-core.")
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
    show.add_argument("--world-size", type=int, default=None,
                      help="also check the batch sizes against this many ranks")
    show.add_argument("--no-validate", action="store_true", help="skip the cross-field checks")
    show.set_defaults(run=_config_show)
    keys = config.add_parser("keys", help="list every config key with its type and default")
    keys.set_defaults(run=_config_keys)


def _config_show(args: argparse.Namespace) -> int:
    from megatron_grpo.config import load_config, to_yaml, validate

    config = load_config(args.recipe, args.overrides)
    if not args.no_validate:
        validate(config, world_size=args.world_size)
    sys.stdout.write(to_yaml(config))
    return 0


def _config_keys(args: argparse.Namespace) -> int:
    from megatron_grpo.config.coerce import describe, field_types
    from megatron_grpo.config.schema import Config

    def walk(cls: type, prefix: str) -> None:
        defaults = cls()
        for name, tp in field_types(cls).items():
            value = getattr(defaults, name)
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{name}.")
            else:
                print(f"{prefix}{name}\t{describe(tp)}\t{json.dumps(value)}")

    walk(Config, "")
    return 0


def _dispatcher(name: str, command: Command) -> Callable[[argparse.Namespace], Optional[int]]:
    def run(args: argparse.Namespace) -> Optional[int]:
        return load_command(name, command)(list(args.argv))

    return run


def load_command(name: str, command: Command) -> Callable[[list[str]], Optional[int]]:
    """Imports the subcommand's function; a module that does not exist yet is a clear error, but an
    import error inside an existing module propagates (it is a real bug or missing dependency)."""
    module_name, _, function_name = command.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise MegatronGRPOError(
                f"'megatron-grpo {name}' is not implemented yet ({module_name} does not exist)") from None
        raise
    function = getattr(module, function_name, None)
    if not callable(function):
        raise MegatronGRPOError(f"'megatron-grpo {name}' is not implemented yet "
                                f"({command.target} is not a function)")
    return function


if __name__ == "__main__":
    sys.exit(main())
