"""Writes the dotted leaf keys of a verl trainer config, for the verl key table's test.

    python tools/verl_key_list.py VERL/verl/trainer/config/_generated_ppo_trainer.yaml \
        --name ppo_trainer.yaml --source "verl 0.9.1, PyPI wheel verl-0.9.1-py3-none-any.whl (sha256 ...)" \
        > tests/data/verl_0.9.1_ppo_trainer_keys.txt

verl ships each trainer config flattened as _generated_<name>.yaml (Hydra's composition of its
`defaults:` list, checked by verl's CI), so those files hold every key a user can set. A key is a
leaf: a value that is not a non-empty mapping (an empty mapping such as override_config: {} is one
key). Only key names are written: no values, no verl code.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Iterator

import yaml


def leaf_keys(node: Any, prefix: str = "") -> Iterator[str]:
    for key, value in node.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from leaf_keys(value, full + ".")
        else:
            yield full


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("generated_yaml", type=Path, help="verl's _generated_<name>.yaml")
    parser.add_argument("--name", required=True, help="the config it flattens, e.g. ppo_trainer.yaml")
    parser.add_argument("--source", required=True, help="which verl: version, and commit or release file")
    args = parser.parse_args(argv)
    data = yaml.safe_load(args.generated_yaml.read_text(encoding="utf-8"))
    keys = sorted(set(leaf_keys(data)))
    sys.stdout.write(
        f"# The dotted leaf keys of verl's {args.name}, as verl flattens it in {args.generated_yaml.name}.\n"
        f"# Source: {args.source}.\n"
        f"# Written by tools/verl_key_list.py: key names only (no values, no verl code); {len(keys)} keys.\n")
    sys.stdout.write("".join(f"{key}\n" for key in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
