"""verl 0.9.1's own functions, taken by name from its source files (build/verl-0.9.1,
scripts/install_verl_code.sh) and executed unchanged. verl's packages cannot be imported here (verl
pulls Ray and tensordict, which do not install), so each function's source is cut out of its file
with `ast` (decorators, such as the estimator registry's, left off) and run in a namespace that
holds only what those functions read."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from tests.requirements import missing

VERL_ROOT = Path(__file__).resolve().parents[1] / "build/verl-0.9.1/verl"


def verl_definitions(relative_file: str, names: list[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """Executes the top-level functions / classes `names` of verl/<relative_file> in `namespace`
    (which they may read: imports, helpers from other files); returns the namespace."""
    path = VERL_ROOT / relative_file
    if not path.is_file():
        missing(f"verl 0.9.1's code is not in build/verl-0.9.1 (bash scripts/install_verl_code.sh): {path}")
    tree = ast.parse(path.read_text())
    found = {node.name: node for node in tree.body
             if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names}
    absent = sorted(set(names) - set(found))
    if absent:
        raise LookupError(f"{path} defines no {', '.join(absent)} (another verl version?)")
    for name in names:
        node = found[name]
        node.decorator_list = []
        code = compile(ast.Module(body=[node], type_ignores=[]), f"{path}:{name}", "exec")
        exec(code, namespace)  # noqa: S102 - verl's own code, from its installed wheel
    return namespace
