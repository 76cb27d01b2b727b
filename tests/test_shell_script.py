"""A launch script read without running it (config/shell_script.py): what bash would pass, and a
one-line refusal (file:line, the variable) for what only running the script would tell. verl's 74
example scripts are checked against bash's own reading in tests/test_verl_examples.py."""
from __future__ import annotations

import pytest

from megatron_grpo.config.from_verl import read_script
from megatron_grpo.errors import ConfigError

LAUNCH = "python3 -m verl.trainer.main_ppo"


def _items(tmp_path, text: str, *positional: str, **environ: str) -> list[tuple[str, object]]:
    script = tmp_path / "run.sh"
    script.write_text(text)
    return read_script(script, positional, environ).items


@pytest.mark.parametrize("text, items", [
    # redirections, a pipeline, a heredoc whose body holds a launch (text, not a command)
    (f"cat > note.txt <<EOF\n{LAUNCH} a.b=1\nEOF\n{LAUNCH} trainer.nnodes=2 2>&1 | tee log.txt\n",
     [("trainer.nnodes", 2)]),
    # ${X:=d} assigns, ${X:+alt}, ${#X}, string slices, C division and bash's octal literals
    (f'{LAUNCH} a.b=${{X:=7}} a.c=$X a.d=${{X:+set}} a.e=${{#X}} a.f=${{Y:1:2}} a.g=$((-7 / 2)) a.h=$((010))\n',
     [("a.b", 7), ("a.c", 7), ("a.d", "set"), ("a.e", 1), ("a.f", "bc"), ("a.g", -3), ("a.h", 8)]),
    # word splitting of an unquoted variable, not of a quoted one; set -- / shift / "$@"
    ('EXTRA="a.x=1 a.y=2"\nset -- a.z=3 a.w=4\nshift\n' f'{LAUNCH} $EXTRA "$@"\n',
     [("a.x", 1), ("a.y", 2), ("a.w", 4)]),
    # elif / else on tests, a && chain after a test, `exit` after the launch
    ('T=sglang\nif [ "$T" = vllm ]; then N=1\nelif [ "$T" == sglang ]; then N=2\nelse N=3; fi\n'
     '[ -n "$T" ] && M=5\n' f'{LAUNCH} a.n=$N a.m=$M\nexit 0\n{LAUNCH} a.n=9\n',
     [("a.n", 2), ("a.m", 5)]),
])
def test_script_reads_as_bash_would(tmp_path, text, items):
    assert _items(tmp_path, text, Y="abcd") == items


@pytest.mark.parametrize("text, message", [
    ("if [ -f /etc/x ]; then N=4; else N=8; fi\n" f"{LAUNCH} a.n=$N\n",
     "run.sh:1: $N is set under the `if` at line 1, whose condition cannot be read without running it "
     "(the launch reads it at line 2)"),
    ("for k in 1 2; do N=$k; done\n" f"{LAUNCH} a.n=$N\n",
     "run.sh:1: $N is set inside the `for` loop at line 1 (the launch reads it at line 2)"),
    (f"X=abc\n{LAUNCH} a.x=${{X%c}}\n", "run.sh:2: ${X%c} is not read here"),
    (f"{LAUNCH} a.x={{b:1,c:2}}\n", "run.sh:1: the brace expansion {b:1,c:2} in a.x={b:1,c:2} is not read here"),
    (f"{LAUNCH} a.x=1\n{LAUNCH} a.x=2\n", "run.sh: runs verl 2 times (lines 1, 2)"),
    (f"if [ -d /data ]; then\n  {LAUNCH} a.x=1\nfi\n", "run.sh:2: the launch runs under the `if` at line 1"),
    (f"{LAUNCH} --config-name=x\n", "run.sh:1: the launch of verl.trainer.main_ppo passes no key=value override"),
    (f"{LAUNCH} a.x='1\n", "run.sh:1: a ' quote is not closed"),
])
def test_script_refuses_what_only_running_it_would_tell(tmp_path, text, message):
    with pytest.raises(ConfigError) as error:
        _items(tmp_path, text)
    assert str(error.value).startswith(f"{tmp_path / 'run.sh'}") and "\n" not in str(error.value)
    assert message in str(error.value), str(error.value)
