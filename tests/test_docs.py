"""The documentation against the code: the README's size, every relative link and anchor in the
README and docs/ (and benchmarks/README.md), the generated tables (the verl key table in
docs/verl.md, docs/recipe-keys.md: `python scripts/update_doc_tables.py` rewrites both after a schema
change), and the environment example of docs/multi-turn.md."""
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import update_doc_tables  # noqa: E402

PAGES = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces -> '-'."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        out.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return out


def test_the_readme_stays_a_front_door():
    assert len((REPO / "README.md").read_bytes()) <= 15 * 1024


def broken_links(page: Path) -> list[str]:
    """Relative links (and images) whose file or heading anchor does not exist; code is skipped."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    broken = []
    for match in LINK.finditer(text):
        target = match.group(1) or match.group(2)
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with that anchor in {file.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page):
    assert not broken_links(page)


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A section (`x/y`)\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-section-xy) [gone](missing.md) [bad](other.md#nope) "
                    "![img](other.md) [web](https://example.com/x) `[code](missing.md)`\n"
                    "```\n[in a block](missing.md)\n```\n")
    assert broken_links(page) == ["missing.md: no such file", "other.md#nope: no heading with that anchor in other.md"]


def test_the_generated_tables_are_current():
    for page, render in ((update_doc_tables.VERL_PAGE, update_doc_tables.render_verl),
                         (update_doc_tables.KEYS_PAGE, update_doc_tables.render_keys)):
        text = page.read_text(encoding="utf-8")
        assert render(text) == text, f"{page.name} is stale: run `python scripts/update_doc_tables.py`"


def test_a_missing_key_is_noticed():
    text = update_doc_tables.KEYS_PAGE.read_text(encoding="utf-8")
    stale = text.replace("| `rollout.max_staleness` | int | `0` |  |\n", "")
    assert stale != text and update_doc_tables.render_keys(stale) == text


def test_unwired_keys_are_marked():
    from megatron_grpo.config.validate import NOT_YET_WIRED

    text = update_doc_tables.KEYS_PAGE.read_text(encoding="utf-8")
    marked = set(re.findall(r"^\| `([^`]+)` \|.*\| not wired yet", text, re.M))
    assert marked == set(NOT_YET_WIRED)


def test_the_environment_example_runs(tmp_path):
    """docs/multi-turn.md's 20-line environment, loaded as users load it (file.py:Class), plays an episode."""
    from megatron_grpo.data.records import PromptRecord
    from megatron_grpo.environments.loader import load_environment_class

    page = (REPO / "docs" / "multi-turn.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n# guess_env.py\n(.*?)```", page, re.S).group(1)
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
