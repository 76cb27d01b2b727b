"""docs/architecture.md against the code: the import rules of its layer table, the one place that
knows HF parameter names, the patch list, version-specific megatron calls, the modules and paths it
names, and no reference to design notes outside the repository. Everything is read with `ast`
(imports inside functions count too); nothing is imported."""
import ast
import re
import subprocess
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "megatron_grpo"
DOC = REPO / "docs" / "architecture.md"

# The layer table of docs/architecture.md: what each package may import from the project.
ALLOWED = {
    "errors": set(),
    "cli_args": set(),
    "optional": {"errors"},
    "config": {"errors"},
    "algo": {"errors", "config"},
    "data": {"errors"},
    "launch": {"errors"},
    "ops": {"errors"},
    "models": {"errors", "launch", "ops", "optional"},
    "rewards": {"errors", "data", "launch"},
    "environments": {"errors", "data", "launch", "rewards"},
    "testing": {"errors", "launch"},
    "checkpointing": {"errors", "models"},
    "lora": {"errors", "launch", "models"},
    "convert": {"errors", "cli_args", "checkpointing", "launch", "lora", "models", "optional"},
    "rollout": {"errors", "convert", "launch", "optional"},
    "reward_models": {"errors", "config", "data", "rewards", "rollout"},
    "trainer": {"errors", "optional", "config", "algo", "data", "launch", "lora", "ops", "models", "rewards",
                "environments", "checkpointing", "convert", "rollout", "reward_models"},
    "doctor": {"errors", "cli_args", "config"},
    "plan": {"errors", "cli_args", "config", "algo", "launch", "lora", "ops", "models", "convert", "rollout",
             "trainer"},
    "cli": {"errors", "cli_args", "config"},
    "train": {"cli"},
}
# Third-party packages a package must not import (the table's bold rules, and light reward workers).
FORBIDDEN = {
    "config": {"torch", "megatron", "transformers"},
    "algo": {"megatron"},
    "data": {"torch", "megatron"},
    "rewards": {"torch", "megatron"},
    "environments": {"torch", "megatron"},
    "rollout": {"megatron"},
    "reward_models": {"megatron"},
    "cli": {"torch", "megatron", "transformers"},
    "cli_args": {"torch", "megatron", "transformers"},
}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        package = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        yield rel, package, ast.parse(path.read_text(encoding="utf-8"))


def _imported(tree) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_packages_import_only_what_the_layer_table_allows():
    assert {p for _, p, _ in _modules()} - {"__init__"} == set(ALLOWED), "a package is missing from the table"
    wrong = []
    for rel, package, tree in _modules():
        for name in _imported(tree):
            parts = name.split(".")
            if parts[0] == "megatron_grpo" and len(parts) > 1 and parts[1] != package:
                if parts[1] not in ALLOWED.get(package, set()):
                    wrong.append(f"{rel} imports {name}")
            elif parts[0] in FORBIDDEN.get(package, set()):
                wrong.append(f"{rel} imports {name}")
    assert not wrong, "\n".join(wrong)


# What HF checkpoints call their tensors (Qwen2/3, Llama); megatron's own names differ.
HF_NAME = re.compile(r"\b(model\.layers\.|embed_tokens|lm_head|(q|k|v|o|gate|up|down)_proj|input_layernorm|"
                     r"post_attention_layernorm|self_attn\.|mlp\.(gate|up|down))")


# Known places outside convert/ whose strings name HF tensors, with why (docs/architecture.md).
HF_NAME_EXCEPTIONS = {
    "models/hf_config.py": "an error message: 'biases on q/k/v/o_proj' describes the refused config field",
    "lora/targets.py": "PEFT's target modules and tensor names: PEFT names the HF projections each Megatron "
                       "linear layer fuses (the LoRA twin of convert/mappings.py)",
    "config/names.py": "model.lora.target_modules' vocabulary: PEFT's projection names, as recipes spell them",
    "config/verl_keys.py": "verl's megatron LoRA targets (linear_qkv, ...) translated to PEFT's projection names",
    "rollout/sglang/verify.py": "samples pushed tensors by HF suffix (o_proj / down_proj are split along "
                                "columns in SGLang): to come from convert/mappings.py",
}


def _docstrings(tree) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def test_only_convert_knows_hf_parameter_names():
    found = {}
    for rel, package, tree in _modules():
        if package == "convert":
            continue
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                    and HF_NAME.search(node.value)):
                found.setdefault(str(rel), []).append(f"{node.lineno}: {node.value!r}")
    assert set(found) == set(HF_NAME_EXCEPTIONS), found


THIRD_PARTY = ("megatron", "torch", "transformers", "safetensors", "sglang")
PATCHING_MODULES = {Path("launch/cpu.py"), Path("launch/lifetime.py"), Path("launch/safe_dcp.py"),
                    Path("launch/mcore_compat.py"), Path("plan/fake_rank.py")}


def _patches(tree):
    """Assignments to attributes of imported third-party modules / classes, setattr on a module-like
    name, and __class__ assignments, as (line, text)."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in THIRD_PARTY}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in THIRD_PARTY:
            bound |= {a.asname or a.name for a in node.names}

    def base(node):
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and (base(target) in bound or target.attr == "__class__"):
                yield node.lineno, ast.unparse(target)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and node.args and isinstance(node.args[0], ast.Name)):
            yield node.lineno, f"setattr({ast.unparse(node.args[0])}, ...)"


def test_third_party_code_is_patched_only_where_the_doc_says():
    found = {}
    for rel, _, tree in _modules():
        for line, text in _patches(tree):
            found.setdefault(rel, []).append((line, text))
    per_instance = {Path("models/builder.py"): ["model.rotary_pos_emb.__class__"],
                    Path("models/fp32_head.py"): ["output_layer.__class__"]}
    assert set(found) - set(per_instance) <= PATCHING_MODULES, found
    # the class of one model instance's rotary embedding / output layer, nothing process-wide
    for module, changes in per_instance.items():
        assert [text for _, text in found.get(module, [])] == changes, module
    assert set(found) >= PATCHING_MODULES, "a listed patching module patches nothing: update the doc"


# megatron-core modules whose functions changed between 0.16 and 0.19 (launch/mcore_compat.py).
VERSION_SPECIFIC = ("megatron.core.models.gpt.gpt_layer_specs", "megatron.core.dist_checkpointing.strategies")


def test_version_specific_megatron_modules_only_in_mcore_compat():
    users = sorted(str(rel) for rel, _, tree in _modules() if rel != Path("launch/mcore_compat.py")
                   and any(name.startswith(VERSION_SPECIFIC) for name in _imported(tree)))
    assert users == [], users


def test_the_doc_names_every_trainer_module_and_package_and_only_paths_that_exist():
    doc = DOC.read_text(encoding="utf-8")
    for path in sorted((PACKAGE / "trainer").rglob("*.py")):
        if path.name != "__init__.py":
            assert f"`{path.name}`" in doc or f"trainer/{path.name}" in doc, f"trainer/{path.name} is not in {DOC.name}"
    for package in sorted(p for p in (PACKAGE / "trainer").iterdir() if (p / "__init__.py").is_file()):
        assert f"`trainer/{package.name}/`" in doc, f"trainer/{package.name}/ is not in {DOC.name}"
    for package in ALLOWED:
        assert f"`{package}/`" in doc or f"`{package}.py`" in doc, f"{package} is not in {DOC.name}'s layers"
    named = set(re.findall(r"`((?:[\w.]+/)+[\w.]+\.(?:py|md|sh)|[\w]+/)`", doc)) | \
        set(re.findall(r"((?:tests|scripts|benchmarks|tools|slurm|docs)/[\w/]+\.(?:py|sh|md))", doc))
    missing = [name for name in named
               if not any((root / name).exists() for root in (REPO, PACKAGE, PACKAGE / "trainer"))
               and not any(list((PACKAGE / "trainer").glob(f"*/{name}")))]
    assert not missing, f"{DOC.name} names paths that do not exist: {missing}"


def test_no_reference_to_design_notes_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    pattern = re.compile(r"DESIGN\.md|\.\./shared/|shared/reference")
    found = []
    for name in files:
        path = REPO / name
        if name == "tests/test_architecture.py" or not path.is_file() or path.suffix in (".png", ".parquet"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += [f"{name}:{i}" for i, line in enumerate(text.splitlines(), 1) if pattern.search(line)]
    assert not found, found


def _module_imports() -> dict[str, set[str]]:
    """Each project module's imports of project modules, function-level ones included and
    TYPE_CHECKING blocks not (they never run); `from pkg import sub` imports the module pkg.sub."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("megatron_grpo",) + path.relative_to(PACKAGE).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = ast.parse(path.read_text("utf-8"))
    graph = {}
    for name, tree in modules.items():
        skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        imported = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{alias.name}" for alias in node.names} & set(modules)
                imported |= subs or {node.module}
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def test_no_import_circle_between_modules():
    """No module imports, even lazily, one that imports it back (directly or around a circle):
    a circle is a layering mistake a lazy import only hides."""
    graph = _module_imports()
    circles, state = [], {}

    def visit(name, path):
        state[name] = "open"
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                circles.append(" -> ".join(path[path.index(other):] + [other]))
            elif other not in state:
                visit(other, path + [other])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "\n".join(circles)
