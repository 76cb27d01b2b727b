"""README.md against the code: its generated tables (the verl key table and "Every recipe key";
`python scripts/update_readme_tables.py` rewrites them after a schema change) and its example
environment."""
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


def test_the_readme_environment_example_runs(tmp_path):
    """The README's 20-line environment, loaded as users load it (file.py:Class), plays an episode."""
    import re

    from megatron_grpo.data.records import PromptRecord
    from megatron_grpo.environments.loader import load_environment_class

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n# guess_env.py\n(.*?)```", readme, re.S).group(1)
    (tmp_path / "guess_env.py").write_text(code, encoding="utf-8")
    env = load_environment_class(f"{tmp_path / 'guess_env.py'}:GuessEnvironment")(max_hints=3)
    messages = env.reset(PromptRecord(data_source="t", prompt=[{"role": "user", "content": "guess"}],
                                      ground_truth="5"))
    assert messages[-1] == {"role": "user", "content": "guess"}
    hint = env.step('<tool_call>{"name": "hint", "arguments": {"guess": 7}}</tool_call>')
    assert [m["content"] for m in hint.observations] == ["lower"] and not hint.done
    bad = env.step("<tool_call>{not json</tool_call>")
    assert bad.counters["tool_call_errors"] == 1 and bad.observations[0]["content"].startswith("error:")
    answer = env.step("5")
    assert answer.done and answer.reward == 1.0
