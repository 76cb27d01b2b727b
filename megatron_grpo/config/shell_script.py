"""A launch script read without running it: the arguments of the command it launches, as bash would
pass them, from the subset of bash that launch scripts are written in (verl's examples).

Read: assignments (`NAME=value`, `export` / `declare` / `local` / `readonly`, `NAME+=`, arrays
`NAME=(...)`), `$NAME`, `${NAME}`, `${NAME:-word}` and the other default / alternative forms,
`${NAME[@]}`, `"$@"` (the arguments given after the script), `$((...))` integer arithmetic,
quoting, backslash continuations, comments, heredocs, word splitting, `if` / `elif` / `else` on
`[ ... ]` string and integer tests, `&&` / `||` after such tests, `set -- ...` and `shift`. Other
commands (`mkdir`, `echo`, `python get_model.py`, ...) are not run: they set no variable.

What cannot be known without running the script is refused where the launch needs it, never
guessed: a variable set neither in the script nor in the environment, a command substitution
`$(...)`, an assignment inside a loop or under a condition that is not such a test. ShellError
names file:line and the variable. Globs are not expanded (a Hydra list `[a,b]` matches no file).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence, Union

from megatron_grpo.config.shell_arithmetic import evaluate
from megatron_grpo.config.shell_words import (NAME, Arithmetic, Command, Lexer, Literal, Parameter, ShellError,
                                              Unreadable, Word, split_commands)
from megatron_grpo.errors import ConfigError

_IFS = re.compile(r"[ \t\n]+")
_BRACES = re.compile(r"\{[^{}\s]*,[^{}\s]*\}")  # unquoted {a,b}: bash's brace expansion
_KEYWORDS = {"then", "do", "!", "time"}  # words that lead a command without changing what it does


# ------------------------------------------------------------------ values

@dataclass
class _Unknown:
    """A variable whose value the reader cannot know; raised as Unreadable when it is used."""
    line: int
    message: str


Value = Union[str, list[str], _Unknown]


@dataclass
class _Frame:
    kind: str           # 'if', 'loop', 'case', 'group', 'subshell'
    line: int
    state: str          # 'run', 'skip' (this branch does not run), 'done' (an earlier branch ran), 'unknown'
    why: str = ""       # for 'unknown': what cannot be read


@dataclass
class Launch:
    arguments: list[tuple[str, int]]  # (argument, line) after `-m MODULE`
    module: str
    line: int


@dataclass
class ScriptReading:
    launches: list[Launch] = field(default_factory=list)
    not_read: list[str] = field(default_factory=list)  # "LINE: command": commands that may set variables


class _Reader:
    """Runs through the commands as bash would, keeping variables instead of running programs."""

    def __init__(self, where: str, positional: Sequence[str], environ: Mapping[str, str],
                 is_launch: Callable[[str], bool]):
        self.where, self.positional, self.environ = where, list(positional), environ
        self.is_launch = is_launch
        self.variables: dict[str, Value] = {"0": where, "BASH_SOURCE": [where]}
        self.frames: list[_Frame] = []
        self.reading = ScriptReading()
        self.status: Optional[bool] = True  # of the last command: True, False, None = cannot tell
        self.function_next = False

    # ---------------------------------------------------------- structure

    def mode(self, frames: Optional[list[_Frame]] = None) -> tuple[str, str]:
        """('run' | 'skip' | 'unknown', why) of the commands here."""
        frames = self.frames if frames is None else frames
        if any(f.state in ("skip", "done") for f in frames):
            return "skip", ""
        unknown = [f for f in frames if f.state == "unknown"]
        return ("unknown", unknown[-1].why) if unknown else ("run", "")

    def read(self, commands: list[Command]) -> ScriptReading:
        try:
            self.run(commands)
        except _Exit:
            return self.reading
        if self.frames:
            frame = self.frames[-1]
            raise ShellError(f"{self.where}:{frame.line}: this `{frame.kind}` is not closed")
        return self.reading

    def run(self, commands: list[Command]) -> None:
        i = 0
        while i < len(commands):
            command = commands[i]
            i += 1
            words = list(command.words)
            guard = None
            if command.before in ("&&", "||"):
                if self.status is None:
                    guard = f"`{command.before}` after a command whose result cannot be known without running it"
                elif self.status != (command.before == "&&"):
                    continue  # skipped by the list, the status stays
            elif command.before == "|" or command.after == "|":
                guard = "pipeline"
            while words and words[0].literal() in _KEYWORDS:
                words = words[1:]
            if not words:
                continue
            keyword = words[0].literal()
            if keyword in ("if", "elif", "while", "until", "for", "select", "case", "fi", "done", "esac",
                           "{", "}", "(", ")", "function", "else"):
                if guard not in (None, "pipeline") and keyword in ("{", "("):
                    self.function_next = True  # `test && { ...; }`: read as not known to run
                self.structure(keyword, words, command)
                continue
            if len(words) == 1 and i < len(commands) and commands[i].words[0].literal() == "(" \
                    and i + 1 < len(commands) and commands[i + 1].words[0].literal() == ")":
                i += 2  # name() { ... }: a function; its body is read as not run here
                self.function_next = True
                continue
            mode, why = self.mode()
            if mode == "skip":
                continue
            if guard is not None and mode == "run":
                mode, why = ("pipeline", "") if guard == "pipeline" else ("unknown", guard)
            if guard is not None and mode == "unknown" and not why:
                why = guard
            self.status = self.simple(words, command.line, mode, why)

    def structure(self, keyword: str, words: list[Word], command: Command) -> None:
        line = command.line
        if keyword == "if":
            self.frames.append(_Frame("if", line, *self.condition(words[1:], line, self.frames)))
        elif keyword == "elif":
            frame = self.top("if", keyword, line)
            if frame.state == "run":
                frame.state = "done"
            elif frame.state == "skip":
                frame.state, frame.why = self.condition(words[1:], line, self.frames[:-1])
        elif keyword == "else":
            frame = self.top("if", keyword, line)
            frame.state = {"run": "done", "skip": "run"}.get(frame.state, frame.state)
            if len(words) > 1:
                self.run([Command(words[1:], line, ";")])
        elif keyword in ("while", "until", "for", "select"):
            self.frames.append(_Frame("loop", line, "unknown", f"inside the `{keyword}` loop at line {line}"))
        elif keyword == "case":
            self.frames.append(_Frame("case", line, "unknown", f"inside the `case` at line {line}"))
        elif keyword == "function":
            self.function_next = True
        elif keyword in ("{", "("):
            if self.function_next:
                self.function_next = False
                self.frames.append(_Frame("group", line, "unknown", f"inside the function at line {line}"))
            elif keyword == "(":
                self.frames.append(_Frame("subshell", line, "unknown", f"inside the subshell ( ... ) at line {line}"))
            else:
                self.frames.append(_Frame("group", line, "run"))
            if len(words) > 1:
                self.run([Command(words[1:], line, ";")])
        elif keyword == ")" and self.frames and self.frames[-1].kind == "case":
            pass  # a case pattern's end
        else:
            closes = {"fi": "if", "done": "loop", "esac": "case", "}": "group", ")": "subshell"}[keyword]
            self.top(closes, keyword, line)
            self.frames.pop()
            self.status = True

    def top(self, kind: str, keyword: str, line: int) -> _Frame:
        if not self.frames or self.frames[-1].kind != kind:
            raise ShellError(f"{self.where}:{line}: `{keyword}` without its `{kind}`")
        return self.frames[-1]

    def condition(self, words: list[Word], line: int, outer: list[_Frame]) -> tuple[str, str]:
        """An `if` condition: ('run' | 'skip', '') when it is a test the reader can decide, else
        ('unknown', why)."""
        mode, why = self.mode(outer)
        if mode != "run":
            return mode, why  # not evaluated where it does not run
        result = self.evaluated_test(words)
        if result is None:
            return "unknown", f"under the `if` at line {line}, whose condition cannot be read without running it"
        return ("run" if result else "skip"), ""

    def evaluated_test(self, words: list[Word]) -> Optional[bool]:
        try:
            return self.test([f for w in words for f in self.fields(w)])
        except Unreadable:
            return None

    @staticmethod
    def test(fields: list[str]) -> Optional[bool]:
        """`[ ... ]`, `[[ ... ]]`, `test ...`, `true`, `false`, `:`: True / False, or None when not
        a string / integer comparison."""
        if fields in (["true"], [":"]):
            return True
        if fields == ["false"]:
            return False
        if fields[:1] == ["["] and fields[-1:] == ["]"] or fields[:1] == ["[["] and fields[-1:] == ["]]"]:
            fields = fields[1:-1]
        elif fields[:1] == ["test"]:
            fields = fields[1:]
        else:
            return None
        negate = fields[:1] == ["!"]
        fields = fields[1:] if negate else fields
        result: Optional[bool] = None
        if len(fields) == 1:
            result = fields[0] != ""
        elif len(fields) == 2 and fields[0] in ("-z", "-n"):
            result = (fields[1] == "") == (fields[0] == "-z")
        elif len(fields) == 3 and fields[1] in ("=", "==", "!="):
            if not re.search(r"[*?\[]", fields[2]):
                result = (fields[0] == fields[2]) == (fields[1] != "!=")
        elif len(fields) == 3 and fields[1] in ("-eq", "-ne", "-lt", "-le", "-gt", "-ge"):
            try:
                a, b = int(fields[0]), int(fields[2])
            except ValueError:
                return None
            result = {"-eq": a == b, "-ne": a != b, "-lt": a < b, "-le": a <= b, "-gt": a > b,
                      "-ge": a >= b}[fields[1]]
        return None if result is None else result != negate

    # ---------------------------------------------------------- simple commands

    def simple(self, words: list[Word], line: int, mode: str, why: str) -> Optional[bool]:
        assignments = []
        while words and words[0].assignment() is not None:
            assignments.append(words.pop(0))
        if not words:  # NAME=value ...: shell variables
            if mode != "pipeline":  # (a pipeline's commands run in subshells)
                for word in assignments:
                    self.assign(word, mode, why)
            return True
        name = words[0].literal()
        if name in ("export", "declare", "typeset", "local", "readonly"):
            for word in words[1:]:
                if word.assignment() is not None and mode != "pipeline":
                    self.assign(word, mode, why)
            return True
        if name == "unset" and mode != "pipeline":
            for word in words[1:]:
                try:
                    targets = self.fields(word)
                except Unreadable:
                    continue
                for target in targets:
                    if NAME.fullmatch(target):
                        self.set(target, _Unknown(word.line, f"${target} is unset {why}") if mode == "unknown"
                                 else None)
            return True
        if name == "set" and mode == "run":
            if len(words) > 1 and words[1].literal() == "--":
                try:
                    self.positional = [f for w in words[2:] for f in self.fields(w)]
                except Unreadable as exc:
                    raise ShellError(f"{self.where}:{exc.line}: {exc.message}") from None
            return True
        if name == "shift" and mode == "run":
            count = words[1].literal() if len(words) > 1 else "1"
            if count is None or not count.isdigit():
                raise ShellError(f"{self.where}:{line}: `shift` by a count that is not a number is not read here")
            self.positional = self.positional[int(count):]
            return True
        if name in ("exit", "return") and mode == "run":
            raise _Exit()
        if name in ("cd", "pushd", "popd") and mode != "pipeline":
            self.set("PWD", _Unknown(line, f"$PWD is changed by `{name}` at line {line}"))
            return True
        if name in ("source", ".", "eval", "read", "mapfile", "readarray", "getopts", "printf"):
            if name != "printf" or any(w.literal() == "-v" for w in words):
                shown = " ".join(w.raw for w in words)
                self.reading.not_read.append(f"{self.where}:{line}: `{shown}` (may set variables; not read)")
            return None
        if name in ("echo", ":", "true"):
            return True
        if name == "false":
            return False
        if name in ("[", "[[", "test"):
            return self.evaluated_test(words)
        self.launch(words, line, mode, why)
        return True  # other commands are taken to succeed, as the script's author expects

    def launch(self, words: list[Word], line: int, mode: str, why: str) -> None:
        """Records the command when it runs `python -m MODULE` with a module is_launch accepts."""
        fields: list[tuple[Optional[str], int, Optional[Unreadable]]] = []
        for word in words:
            try:
                fields.extend((f, word.line, None) for f in self.fields(word))
            except Unreadable as exc:
                fields.append((None, word.line, exc))
        for k in range(len(fields) - 1):
            module = fields[k + 1][0]
            if fields[k][0] == "-m" and module is not None and self.is_launch(module):
                if mode == "unknown":
                    raise ShellError(f"{self.where}:{line}: the launch runs {why}: give its arguments as a "
                                     "command line instead")
                arguments = []
                for text, word_line, error in fields[k + 2:]:
                    if error is not None:
                        used = f" (the launch reads it at line {word_line})" if word_line != error.line else ""
                        raise ShellError(f"{self.where}:{error.line}: {error.message}{used}")
                    arguments.append((text, word_line))  # type: ignore[arg-type]
                self.reading.launches.append(Launch(arguments, module, line))
                return

    def assign(self, word: Word, mode: str, why: str) -> None:
        name, append, value = word.assignment()  # type: ignore[misc]
        if mode == "unknown":
            self.set(name, _Unknown(word.line, f"${name} is set {why}"))
            return
        try:
            if value.array is not None:
                new: Value = [f for element in value.array for f in self.fields(element)]
            else:
                new = self.joined(value, assignment=True)
        except Unreadable as exc:
            self.set(name, _Unknown(exc.line, f"${name} cannot be known: {exc.message}"))
            return
        old = self.variables.get(name, self.environ.get(name))
        if append and isinstance(old, _Unknown) and old is not _UNSET:
            new = old
        elif append and isinstance(old, (str, list)):
            new = (old + new) if isinstance(old, list) and isinstance(new, list) else \
                ([*old, new] if isinstance(old, list) else old + (" ".join(new) if isinstance(new, list) else new))
        self.set(name, new)

    def set(self, name: str, value: Optional[Value]) -> None:
        """None: `unset` (neither the script's value nor the environment's)."""
        self.variables[name] = _UNSET if value is None else value

    # ---------------------------------------------------------- expansion

    def lookup(self, name: str, line: int) -> Optional[Union[str, list[str]]]:
        """The variable's value, None when unset (script first, then the environment)."""
        if name == "@" or name == "*":
            return list(self.positional)
        if name == "#":
            return str(len(self.positional))
        if name.isdigit() and name != "0":
            k = int(name)
            return self.positional[k - 1] if k <= len(self.positional) else None
        if name in ("?", "$", "!", "-", "RANDOM"):
            raise Unreadable(line, f"${name} is only known while the script runs")
        value = self.variables.get(name)
        if value is _UNSET:
            return None
        if isinstance(value, _Unknown):
            raise Unreadable(value.line, value.message)
        if value is None:
            return self.environ.get(name)
        return value

    def never_set(self, name: str, line: int) -> Unreadable:
        hint = f"; {self.reading.not_read[0]}" if self.reading.not_read else ""
        return Unreadable(line, f"${name} is set neither in the script nor in the environment{hint}")

    def parameter(self, part: Parameter, line: int) -> list[tuple[str, str]]:
        """Segments (kind, text) of one $-expansion: kind 'q' (not split), 's' (split on IFS),
        'f' (one field each: "$@", "${A[@]}")."""
        if part.unsupported:
            raise Unreadable(line, f"{part.unsupported} is not read here (only ${{NAME}}, ${{NAME:-word}} "
                                   "and the other default / alternative forms)")
        value = self.lookup(part.name, line)
        if isinstance(value, list) and part.index not in ("@", "*") and part.name not in ("@", "*"):
            index = int(part.index or 0)
            value = value[index] if index < len(value) else None
        elif isinstance(value, str) and part.index not in ("", "0", "@", "*"):
            value = None
        if part.length:
            count = len(value) if isinstance(value, list) else len(value or "")
            return [("q", str(count))]
        if part.op == ":":
            return self.sliced(part, value, line)
        is_set = value is not None and (part.op[:1] != ":" or value not in ("", []))
        if part.op.endswith(("-", "=")) and not is_set:
            assert part.word is not None
            segments = self.word_segments(part)
            if part.op.endswith("="):
                self.set(part.name, "".join(t if k != "f" else " ".join(t) for k, t in segments))  # type: ignore
            return segments
        if part.op.endswith("+"):
            return self.word_segments(part) if is_set else []
        if part.op.endswith("?") and not is_set:
            raise Unreadable(line, f"${part.name} is not set (the script stops there: ${{{part.name}{part.op}...}})")
        if value is None:
            raise self.never_set(part.name, line)
        if isinstance(value, list):
            if part.quoted and (part.name == "@" or part.index == "@"):
                return [("f", value)]  # type: ignore[list-item]
            value = " ".join(value)
        return [("q" if part.quoted else "s", value)]

    def sliced(self, part: Parameter, value: Optional[Union[str, list[str]]], line: int) -> list[tuple[str, str]]:
        """${X:offset:length} of a string, ${A[@]:offset:length} of an array, ${@:offset} of the
        script's arguments (where offset 1 is $1)."""
        if value is None:
            raise self.never_set(part.name, line)
        offset_text, _, length_text = part.slice.partition(":")
        offset = self.arithmetic(offset_text, line)
        if part.name in ("@", "*"):
            value = [self.where, *value]  # ${@:0} starts at $0
        length = self.arithmetic(length_text, line) if length_text else len(value)
        start = offset if offset >= 0 else max(len(value) + offset, 0)
        stop = start + length if length >= 0 else len(value) + length
        piece = value[start:stop]
        if isinstance(piece, list):
            if part.quoted and (part.name == "@" or part.index == "@"):
                return [("f", piece)]  # type: ignore[list-item]
            piece = " ".join(piece)
        return [("q" if part.quoted else "s", piece)]

    def word_segments(self, part: Parameter) -> list[tuple[str, str]]:
        """The word of ${NAME:-word}: split where the expansion is unquoted, as bash does."""
        assert part.word is not None
        segments = self.segments(part.word, part.quoted)
        return [("s" if kind == "l" else kind, text) for kind, text in segments]

    def segments(self, word: Word, quoted: bool = False) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for part in word.parts:
            if isinstance(part, Literal):
                out.append(("q" if part.quoted or quoted else "l", part.text))
            elif isinstance(part, Parameter):
                if quoted and not part.quoted:
                    part = Parameter(**{**part.__dict__, "quoted": True})
                out.extend(self.parameter(part, word.line))
            elif isinstance(part, Arithmetic):
                out.append(("q" if part.quoted or quoted else "s", str(self.arithmetic(part.text, word.line))))
            else:
                raise Unreadable(word.line, f"the command substitution {_short(part.text)} is known only "
                                            "by running the script")
        return out

    def fields(self, word: Word) -> list[str]:
        """The arguments one word becomes: expansions, word splitting of unquoted expansions,
        tilde at the start; no globbing."""
        segments = self.segments(word)
        braces = next((m.group() for kind, text in segments if kind == "l" for m in [_BRACES.search(text)] if m), None)
        if braces is not None:  # bash would make several words of it
            raise Unreadable(word.line, f"the brace expansion {braces} in {word.raw or 'a word'} is not read here: "
                                        "quote the value")
        if segments and segments[0][0] == "l" and segments[0][1].startswith("~"):
            segments[0] = ("l", self.tilde(segments[0][1], word.line))
        fields: list[str] = []
        current, have = "", False
        for kind, text in segments:
            if kind in ("l", "q"):
                current, have = current + text, True
            elif kind == "f":
                for k, element in enumerate(text):
                    if k:
                        fields.append(current)
                        current = ""
                    current, have = current + element, True
            else:
                for k, piece in enumerate(_IFS.split(text)):
                    if k and have:
                        fields.append(current)
                        current, have = "", False
                    if piece:
                        current, have = current + piece, True
        if have:
            fields.append(current)
        return fields

    def joined(self, word: Word, assignment: bool = False) -> str:
        """A word as one string (an assignment's value: no splitting; tilde after = and :)."""
        segments = self.segments(word)
        text = "".join(" ".join(t) if k == "f" else t for k, t in segments)  # type: ignore[arg-type]
        if assignment and segments and segments[0][0] == "l":
            first = ":".join(self.tilde(piece, word.line) for piece in segments[0][1].split(":"))
            text = first + text[len(segments[0][1]):]
        return text

    def tilde(self, text: str, line: int) -> str:
        if text == "~" or text.startswith("~/"):
            home = self.lookup("HOME", line)
            if home is None:
                raise self.never_set("HOME", line)
            return str(home) + text[1:]
        return text

    # ---------------------------------------------------------- $(( ))

    def arithmetic(self, text: str, line: int) -> int:
        """$((text)): $NAME inside expands first, as in bash."""
        parts = Lexer(text, self.where).text_parts() if "$" in text or "`" in text else [Literal(text, True)]
        expanded = "".join(" ".join(t) if k == "f" else t for k, t in self.segments(Word(parts, line)))
        return evaluate(expanded, lambda name: self.arithmetic_variable(name, line), line)

    def arithmetic_variable(self, name: str, line: int) -> int:
        value = self.lookup(name, line)
        if value is None:
            raise self.never_set(name, line)
        text = value[0] if isinstance(value, list) and value else value
        return self.arithmetic(str(text or "0"), line)


class _Exit(Exception):
    """`exit` / `return` in the script's main body: nothing after it runs."""


_UNSET = _Unknown(-1, "unset")


def _short(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def read_launches(path: Path, positional: Sequence[str], environ: Mapping[str, str],
                  is_launch: Callable[[str], bool]) -> ScriptReading:
    """Every launch (`python -m MODULE ...` with is_launch(MODULE)) the script at `path` runs, with
    its arguments as bash passes them; `positional` are the script's own arguments ("$@") and
    `environ` fills names the script does not set."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"cannot read {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    where = str(path)
    return _Reader(where, positional, environ, is_launch).read(split_commands(text, where))


def looks_like_a_script(text: str) -> bool:
    """A shell script rather than YAML: a #! line, or a `python -m` command among its lines."""
    return text.startswith("#!") or re.search(r"(^|\s)python[0-9.]*\s+-m\s", text) is not None


__all__ = ["Launch", "ScriptReading", "ShellError", "looks_like_a_script", "read_launches"]
