"""Plans every shipped sbatch recipe on its own cluster shape (the #SBATCH header), writes
tests/data/recipe_plans.json, rewrites each recipe's "-> memory plan" comment from it (the test
tests/test_memory_plan.py checks they agree) and prints the README's table (markdown).

    .venv/bin/python scripts/recipe_plans.py                   # ~4 min on 2 cores
    .venv/bin/python scripts/recipe_plans.py RECIPE [RECIPE]   # plans only these, keeps the others' figures
    .venv/bin/python scripts/recipe_plans.py --from-json       # comments + table from the JSON only
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "data" / "recipe_plans.json"
GPU_SIZES_GIB = (80, 141)  # H100, H200


def sbatch_clusters() -> dict[str, tuple[int, int]]:
    """{recipe: (nodes, gpus per node)} from slurm/grpo_*.sh (the tiny CPU script aside): each
    script's default recipe, and the recipes whose header says `Launch: RECIPE=<it> sbatch <script>`."""
    shapes, out = {}, {}
    for script in sorted((REPO / "slurm").glob("grpo_*.sh")):
        text = script.read_text()
        recipe = re.search(r': "\$\{RECIPE:=(\w+)\}"', text)
        nodes = re.search(r"#SBATCH --nodes=(\d+)", text)
        gpus = re.search(r"#SBATCH --gpus-per-node=(\d+)", text)
        if recipe and nodes and gpus and "tiny" not in recipe.group(1):
            shapes[script.name] = out[recipe.group(1)] = (int(nodes.group(1)), int(gpus.group(1)))
    for path in sorted((REPO / "megatron_grpo" / "recipes").glob("*.yaml")):
        launch = re.search(r"^#\s+Launch: RECIPE=(\w+) sbatch slurm/(\S+\.sh)", path.read_text(), re.M)
        if launch and launch.group(2) in shapes:
            out[launch.group(1)] = shapes[launch.group(2)]
    return out


def plan_comment(recipe: str, plan: dict) -> str:
    """The two comment lines a recipe carries (recipes/<recipe>.yaml)."""
    stage = max(plan["stages"], key=lambda s: s["peak_bytes"])
    host = max(s["save_host_bytes"] for s in plan["stages"])
    return (f"#   -> memory plan (megatron-grpo plan {recipe} --nodes {plan['nodes']}, GPUs of 80 GiB): peak "
            f"{stage['peak_bytes'] / 2**30:.1f} GiB per GPU\n"
            f"#      (stage {stage['stage'] + 1}, {stage['peak_phase']}); a save also holds {host / 2**30:.0f} GiB "
            f"of host memory per GPU\n")


def write_comments(plans: dict) -> None:
    for recipe, plan in plans.items():
        path = REPO / "megatron_grpo" / "recipes" / f"{recipe}.yaml"
        text = path.read_text()
        comment = plan_comment(recipe, plan)
        new, count = re.subn(r"#   -> memory plan \(.*\n#      \(.*\n", comment.replace("\\", r"\\\\"), text)
        if count != 1:
            raise SystemExit(f"{path}: expected one '#   -> memory plan (' comment of two lines, found {count}")
        path.write_text(new)


def main() -> int:
    if "--from-json" in sys.argv[1:]:
        plans = json.loads(OUT.read_text())
        write_comments(plans)
        print(markdown(plans))
        return 0
    from megatron_grpo.config import load_config
    from megatron_grpo.plan.cli import quiet_third_party
    from megatron_grpo.plan.cluster import Cluster
    from megatron_grpo.plan.recipe_plan import plan_recipe
    from megatron_grpo.plan.summary import summary

    quiet_third_party()
    clusters = sbatch_clusters()
    only = [arg for arg in sys.argv[1:] if not arg.startswith("-")]
    unknown = sorted(set(only) - set(clusters))
    if unknown:
        raise SystemExit(f"not a planned recipe (no sbatch script launches it): {', '.join(unknown)}")
    known = json.loads(OUT.read_text()) if only and OUT.is_file() else {}
    plans = {}
    for recipe, (nodes, gpus) in clusters.items():
        if only and recipe not in only and recipe in known:
            plans[recipe] = known[recipe]
            continue
        print(f"{recipe}: {nodes} nodes x {gpus} GPUs", file=sys.stderr, flush=True)
        plan = plan_recipe(load_config(recipe), Cluster(nodes, gpus, GPU_SIZES_GIB[0]))
        plans[recipe] = {"nodes": nodes, "gpus_per_node": gpus, **summary(plan)}
        plans[recipe]["fits_gib"] = {str(size): max(s["peak_bytes"] for s in plans[recipe]["stages"])
                                     <= (size - plan.cluster.reserve_gb) * 2**30 for size in GPU_SIZES_GIB}
    OUT.write_text(json.dumps(plans, indent=1, sort_keys=True) + "\n")
    write_comments(plans)
    print(markdown(plans))
    return 0


def markdown(plans: dict) -> str:
    gib = lambda b: f"{b / 2**30:.1f}"  # noqa: E731
    rows = ["| recipe (nodes x GPUs) | trainer layout | per-stage peak GiB (phase) | engine KV tokens / step tokens "
            "per engine | sync GiB | 80 / 141 GiB |", "|---|---|---|---|---|---|"]
    for recipe, p in plans.items():
        peaks = "; ".join(f"{gib(s['peak_bytes'])} ({s['peak_phase'].split(' ')[0]})" for s in p["stages"])
        e = p["engines"]
        kv = f"{e['capacity_tokens'] / 1e3:.0f}k / {e['step_tokens_per_engine'] / 1e3:.0f}k" if e else "-"
        sync = gib(p["sync"]["model_bytes"]) if p["sync"] else "-"
        fits = " / ".join("fits" if p["fits_gib"][str(s)] else "no" for s in GPU_SIZES_GIB)
        rows.append(f"| {recipe} ({p['nodes']}x{p['gpus_per_node']}) | {p['placement']['trainer_gpus']} GPUs, "
                    f"{p['placement']['kind']} engines | {peaks} | {kv} | {sync} | {fits} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
