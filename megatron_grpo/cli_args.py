"""The command lines' checks of their own flags: argparse `type=` functions for numbers, sizes,
ports and output paths, and the parser that reports a bad flag in one line (`error: --nodes must be
a positive integer, got 0`, exit 2). They run while the arguments are parsed: before a recipe is
loaded, a plan simulated or a checkpoint read, so a typo costs no minute of work and no traceback."""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path
from typing import NoReturn

_ARGUMENT = re.compile(r"^argument ([^:/]+)(?:/[^:]*)?: ")


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors, as every user error here: `error: --flag what is wrong`
    (argparse's usage lines are in --help). Subparsers made from it are of this class too."""

    def error(self, message: str) -> NoReturn:
        match = _ARGUMENT.match(message)
        line = f"{match.group(1)} {message[match.end():]}" if match else f"{self.prog}: {message}"
        self.exit(2, f"error: {line}\n")


def flag_error(flag: str, message: str) -> NoReturn:
    """A check between flags after parsing, in the same one line (exit 2)."""
    print(f"error: {flag} {message}", file=sys.stderr)
    raise SystemExit(2)


def _integer(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}") from None


def positive_int(text: str) -> int:
    value = _integer(text, "a positive integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def port(text: str) -> int:
    value = _integer(text, "a port number (1 to 65535)")
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (1 to 65535), got {text}")
    return value


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def positive_float(text: str) -> float:
    value = _number(text, "a positive number")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, "a number >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


_UNITS = {"KB": 1024, "MB": 1024**2, "GB": 1024**3, "B": 1}


def byte_size(text: str) -> int:
    """5GB, 500MB, 1000000 (bytes): a positive whole number of bytes."""
    number, factor = text, 1
    for unit, unit_factor in _UNITS.items():
        if text.upper().endswith(unit):
            number, factor = text[: -len(unit)], unit_factor
            break
    try:
        value = float(number) * factor
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be a size such as 5GB, 500MB or 1000000, got {text}")
    return int(value)


def _writable_parent(path: Path, text: str) -> None:
    parent = path.expanduser().absolute().parent
    if not parent.is_dir():
        missing = "is not a folder" if parent.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"{text}: its folder {parent} {missing}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: its folder {parent} is not writable")


def output_file(text: str) -> Path:
    """A file to write: its folder exists and is writable, and it is not a folder itself."""
    path = Path(text)
    if path.expanduser().is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    _writable_parent(path, text)
    return path


def output_folder(text: str) -> Path:
    """A folder to write. Its missing parents are made, as the writers do (`--out exported/run1` in a
    fresh clone), so the nearest folder that exists must be writable; a file in the way is refused."""
    path = path_here = Path(text).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
    while not path_here.parent.exists() and path_here.parent != path_here:
        path_here = path_here.parent
    _writable_parent(path_here, text)
    return Path(text)


__all__ = ["ArgumentParser", "byte_size", "flag_error", "non_negative_float", "output_file", "output_folder",
           "port", "positive_float", "positive_int"]
