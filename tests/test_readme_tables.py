"""README.md's generated tables (the verl key table and "Every recipe key") are what the code
generates now: `python scripts/update_readme_tables.py` rewrites them after a schema change."""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import update_readme_tables  # noqa: E402


def test_readme_tables_are_the_generated_ones():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert update_readme_tables.render(readme) == readme, \
        "README.md's generated tables are stale: run `python scripts/update_readme_tables.py`"


def test_a_missing_key_is_noticed():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    stale = readme.replace("| `rollout.max_staleness` | int | `0` |\n", "")
    assert stale != readme and update_readme_tables.render(stale) == readme
