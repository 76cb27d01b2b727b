"""The words and commands of a shell script, as bash splits them (quotes, $-expansions, arithmetic
and command substitutions kept as parts; backslash continuations, comments and heredocs resolved;
redirections dropped), for shell_script.py to read without running it. Structure (if / fi, loops)
is left to the reader: keywords are plain words here."""
from __future__ import annotations

import codecs
import re
from dataclasses import dataclass
from typing import Optional, Union

from megatron_grpo.errors import ConfigError

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\+?)=")
_OPERATORS = ("&&", "||", ";;", ";&", "|&", ";", "&", "|", "(", ")")
_REDIRECTIONS = ("<<<", "<<-", "&>>", "<<", ">>", ">&", "<&", ">|", "<>", "&>", "<", ">")


class ShellError(ConfigError):
    """A launch script the reader cannot follow; the message names file:line."""


class Unreadable(Exception):
    """A value that cannot be known without running the script (raised while expanding)."""

    def __init__(self, line: int, message: str):
        super().__init__(message)
        self.line = line
        self.message = message

# ------------------------------------------------------------------ words

@dataclass
class Literal:
    text: str
    quoted: bool


@dataclass
class Parameter:
    """$NAME / ${NAME...}: `op` is '' or one of :- - := = :+ + :? ? ; `index` '@', '*', a number or ''."""
    name: str
    quoted: bool
    op: str = ""
    word: Optional["Word"] = None
    index: str = ""
    length: bool = False
    unsupported: str = ""  # ${...} forms not read (${X%y}, ${X/a/b}, ...): the text, refused when expanded
    slice: str = ""        # op ':': "offset[:length]" of ${X:offset:length}, ${@:2}, ${A[@]:1}


@dataclass
class Arithmetic:
    text: str
    quoted: bool


@dataclass
class CommandSubstitution:
    text: str
    quoted: bool


Part = Union[Literal, Parameter, Arithmetic, CommandSubstitution]


@dataclass
class Word:
    parts: list[Part]
    line: int
    array: Optional[list["Word"]] = None  # NAME=( ... ): the parts hold "NAME=" and these the elements
    raw: str = ""                          # as the script writes it

    def literal(self) -> Optional[str]:
        """The word's text when it is plain unquoted text (keywords, `[`), else None."""
        if self.array is None and all(isinstance(p, Literal) and not p.quoted for p in self.parts):
            return "".join(p.text for p in self.parts)  # type: ignore[union-attr]
        return None

    def assignment(self) -> Optional[tuple[str, bool, "Word"]]:
        """(name, append, value word) when the word is NAME=value / NAME+=value."""
        first = self.parts[0] if self.parts else None
        if not isinstance(first, Literal) or first.quoted:
            return None
        match = _ASSIGNMENT.match(first.text)
        if match is None:
            return None
        rest = first.text[match.end():]
        parts = ([Literal(rest, False)] if rest else []) + self.parts[1:]
        return match.group(1), bool(match.group(2)), Word(parts, self.line, self.array)


@dataclass
class Command:
    words: list[Word]
    line: int
    before: str  # the operator that joins it to the previous command: ';' (also a newline), '&&', '||', '|'
    after: str = ";"


# ------------------------------------------------------------------ lexing

class Lexer:
    """Splits the script into commands of words (quotes, expansions, continuations, comments and
    heredocs resolved; redirections dropped); the structure (if / fi, loops) is left to the reader."""

    def __init__(self, text: str, where: str):
        self.text, self.where, self.pos, self.line = text, where, 0, 1
        self.heredocs: list[tuple[str, bool]] = []

    def error(self, message: str, line: Optional[int] = None) -> ShellError:
        return ShellError(f"{self.where}:{line or self.line}: {message}")

    def peek(self, k: int = 0) -> str:
        i = self.pos + k
        return self.text[i] if i < len(self.text) else ""

    def advance(self, n: int = 1) -> str:
        chunk = self.text[self.pos:self.pos + n]
        self.line += chunk.count("\n")
        self.pos += n
        return chunk

    def commands(self) -> list[Command]:
        commands: list[Command] = []
        words: list[Word] = []
        before, start, skip_target = ";", 1, False

        def finish(operator: str) -> None:
            nonlocal words, before
            if words:
                commands.append(Command(words, start, before, operator))
                before = operator
            elif operator in ("&&", "||", "|", "|&"):
                before = operator
            if operator in (";", "&", "\n"):
                before = ";"
            words = []

        while self.pos < len(self.text):
            c = self.peek()
            if c == "\\" and self.peek(1) == "\n":
                self.advance(2)
            elif c in " \t\r":
                self.advance()
            elif c == "\n":
                self.advance()
                self.read_heredocs()
                finish("\n")
            elif c == "#":
                while self.peek() not in ("\n", ""):
                    self.advance()
            elif self.at_redirection():
                skip_target = self.redirection()
            elif any(self.text.startswith(op, self.pos) for op in _OPERATORS):
                op = next(op for op in _OPERATORS if self.text.startswith(op, self.pos))
                self.advance(len(op))
                finish({"|&": "|", ";;": ";", ";&": ";"}.get(op, op))
                if op in ("(", ")"):
                    commands.append(Command([Word([Literal(op, False)], self.line)], self.line, ";"))
            else:
                line = self.line
                word = self.word(line)
                if word is None:  # a file descriptor number before a redirection (2>&1)
                    continue
                if skip_target:
                    skip_target = False
                    continue
                if not words:
                    start = line
                words.append(word)
        finish("\n")
        return commands

    def at_redirection(self) -> bool:
        return any(self.text.startswith(op, self.pos) for op in _REDIRECTIONS)

    def redirection(self) -> bool:
        """Reads a redirection operator (a heredoc's delimiter too); True when its target word
        follows (and is dropped)."""
        op = next(op for op in _REDIRECTIONS if self.text.startswith(op, self.pos))
        self.advance(len(op))
        if op not in ("<<", "<<-"):
            return True
        while self.peek() in (" ", "\t"):
            self.advance()
        delimiter = self.word(self.line)
        text = "".join(p.text for p in delimiter.parts if isinstance(p, Literal)) if delimiter else ""
        self.heredocs.append((text, op == "<<-"))
        return False

    def read_heredocs(self) -> None:
        for delimiter, strip_tabs in self.heredocs:
            start = self.line
            while True:
                if self.pos >= len(self.text):
                    raise self.error(f"the heredoc ending in {delimiter!r} is not closed", start)
                end = self.text.find("\n", self.pos)
                body_line = self.advance((end if end >= 0 else len(self.text) - 1) + 1 - self.pos).rstrip("\n")
                if (body_line.lstrip("\t") if strip_tabs else body_line) == delimiter:
                    break
        self.heredocs = []

    def word(self, line: int) -> Optional[Word]:
        start = self.pos
        word = self._word(line)
        if word is not None:
            word.raw = self.text[start:self.pos].replace("\\\n", "")
        return word

    def _word(self, line: int) -> Optional[Word]:
        parts: list[Part] = []
        while self.pos < len(self.text):
            c = self.peek()
            if c == "\\" and self.peek(1) == "\n":
                self.advance(2)
            elif c in " \t\r\n" or any(self.text.startswith(op, self.pos) for op in (*_OPERATORS, "<", ">")):
                if c in "<>" and parts and all(isinstance(p, Literal) and not p.quoted and p.text.isdigit()
                                               for p in parts):
                    return None  # 2>&1: the descriptor goes with the redirection
                plain = all(isinstance(p, Literal) and not p.quoted for p in parts)
                if c == "(" and plain and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*\+?=",
                                                       "".join(p.text for p in parts)):  # type: ignore[union-attr]
                    self.advance()  # NAME=( ... )
                    return Word(_merged(parts), line, self.array_elements())
                break
            elif c == "\\":
                self.advance()
                if self.pos < len(self.text):  # (a backslash that ends the file escapes nothing)
                    parts.append(Literal(self.advance(), True))
            elif c == "'":
                self.advance()
                end = self.text.find("'", self.pos)
                if end < 0:
                    raise self.error("a ' quote is not closed", line)
                parts.append(Literal(self.advance(end - self.pos), True))
                self.advance()
            elif c == '"':
                self.advance()
                parts.extend(self.double_quoted(line))
            elif c == "$":
                parts.append(self.dollar(quoted=False))
            elif c == "`":
                parts.append(CommandSubstitution(self.backticks(), False))
            else:
                parts.append(Literal(self.advance(), False))
        merged = _merged(parts)
        if not merged:
            return Word([Literal("", False)], line) if parts else None
        return Word(merged, line)

    def array_elements(self) -> list[Word]:
        elements: list[Word] = []
        while True:
            c = self.peek()
            if c == "":
                raise self.error("an array ( ... ) is not closed")
            if c == ")":
                self.advance()
                return elements
            if c == "\\" and self.peek(1) == "\n":
                self.advance(2)
            elif c in " \t\r\n":
                self.advance()
            elif c == "#":
                while self.peek() not in ("\n", ""):
                    self.advance()
            else:
                word = self.word(self.line)
                if word is None or self.peek() == "(":
                    raise self.error("unexpected text in an array ( ... )")
                elements.append(word)

    def double_quoted(self, line: int) -> list[Part]:
        parts: list[Part] = []
        while True:
            c = self.peek()
            if c == "":
                raise self.error('a " quote is not closed', line)
            if c == '"':
                self.advance()
                return parts or [Literal("", True)]  # "" is one empty argument; "$@" may be none
            if c == "\\" and self.peek(1) in '$`"\\\n':
                self.advance()
                escaped = self.advance()
                if escaped != "\n":
                    parts.append(Literal(escaped, True))
            elif c == "$":
                parts.append(self.dollar(quoted=True))
            elif c == "`":
                parts.append(CommandSubstitution(self.backticks(), True))
            else:
                parts.append(Literal(self.advance(), True))

    def dollar(self, quoted: bool) -> Part:
        self.advance()  # $
        c = self.peek()
        if self.text.startswith("((", self.pos):
            return Arithmetic(self.balanced("((", "))")[2:-2], quoted)
        if c == "(":
            return CommandSubstitution("$" + self.balanced("(", ")"), quoted)
        if c == "{":
            return self.braced(self.balanced("{", "}")[1:-1], quoted)
        if c == "'" and not quoted:  # $'...': C escapes
            self.advance()
            end = self.text.find("'", self.pos)
            if end < 0:
                raise self.error("a $' quote is not closed")
            text = self.advance(end - self.pos)
            self.advance()
            return Literal(codecs.decode(text, "unicode_escape"), True)
        if c == '"' and not quoted:  # $"...": a translated string, read as "..."
            return Literal("", True)
        match = NAME.match(self.text, self.pos)
        if match:
            self.advance(match.end() - self.pos)
            return Parameter(match.group(), quoted)
        if c and c in "@*#?$!-0123456789":
            self.advance()
            return Parameter(c, quoted)
        return Literal("$", quoted)

    def balanced(self, opening: str, closing: str) -> str:
        """The text from `opening` to its matching `closing`, quotes and nesting followed."""
        start, line, depth = self.pos, self.line, 0
        pairs = {"(": ")", "{": "}"}
        open_char, close_char = opening[0], pairs[opening[0]]
        while True:
            c = self.peek()
            if c == "":
                raise self.error(f"{'$' + opening} is not closed", line)
            if c == "\\":
                self.advance(2)
                continue
            if c == "'":
                self.advance()
                while self.peek() not in ("'", ""):
                    self.advance()
            elif c == '"':
                self.advance()
                while self.peek() not in ('"', ""):
                    if self.peek() == "\\":
                        self.advance()
                    elif self.peek() == "$" and self.peek(1) in "({":
                        self.advance()
                        self.balanced(self.peek(), pairs[self.peek()])
                        continue
                    self.advance()
            elif c == open_char:
                depth += 1
            elif c == close_char:
                depth -= 1
                if depth == 0:
                    self.advance()
                    text = self.text[start:self.pos]
                    if closing == "))" and not text.endswith("))"):
                        raise self.error("$(( is not closed by ))", line)
                    return text
            self.advance()

    def braced(self, inner: str, quoted: bool) -> Parameter:
        length = inner.startswith("#") and len(inner) > 1
        body = inner[1:] if length else inner
        match = NAME.match(body) or re.match(r"[@*#?$!0-9]", body)
        if match is None:
            return Parameter("", quoted, unsupported="${" + inner + "}")
        name, rest, index = match.group(), body[match.end():], ""
        index_match = re.match(r"\[([@*]|\d+)\]", rest)
        if index_match:
            index, rest = index_match.group(1), rest[index_match.end():]
        if rest == "":
            return Parameter(name, quoted, index=index, length=length)
        if rest.startswith(":") and rest[1:2] not in ("-", "=", "+", "?") and not length:
            return Parameter(name, quoted, op=":", index=index, slice=rest[1:])  # ${X:offset[:length]}
        op_match = re.match(r":?[-=+?]", rest)
        if op_match is None or length:
            return Parameter(name, quoted, unsupported="${" + inner + "}")
        sub = Lexer(rest[op_match.end():], self.where)
        sub.line = self.line
        parts: list[Part] = []
        while sub.pos < len(sub.text):  # the word after the operator: spaces are part of it
            if sub.peek() in " \t\n":
                parts.append(Literal(sub.advance(), False))
            else:
                word = sub.word(sub.line)
                if word is None:
                    parts.append(Literal(sub.advance(), False))
                else:
                    parts.extend(word.parts)
        return Parameter(name, quoted, op=op_match.group(), word=Word(parts, self.line), index=index)

    def backticks(self) -> str:
        start, line = self.pos, self.line
        self.advance()
        while self.peek() != "`":
            if self.peek() == "":
                raise self.error("a ` quote is not closed", line)
            self.advance(2 if self.peek() == "\\" else 1)
        self.advance()
        return self.text[start:self.pos]


    def text_parts(self) -> list[Part]:
        """The whole text as parts, every character literal but $-expansions and `...` (the inside
        of $(( )), where $NAME expands first)."""
        parts: list[Part] = []
        while self.pos < len(self.text):
            if self.peek() == "$":
                parts.append(self.dollar(quoted=True))
            elif self.peek() == "`":
                parts.append(CommandSubstitution(self.backticks(), True))
            else:
                parts.append(Literal(self.advance(), True))
        return _merged(parts)


def split_commands(text: str, where: str) -> list[Command]:
    """The script's simple commands in order, each with the operator joining it to the previous one;
    `(` and `)` are commands of their own. ShellError (file:line) for unclosed quotes."""
    return Lexer(text, where).commands()


def _merged(parts: list[Part]) -> list[Part]:
    """Adjacent literal characters of the same quoting as one literal."""
    merged: list[Part] = []
    for part in parts:
        if merged and isinstance(part, Literal) and isinstance(merged[-1], Literal) \
                and merged[-1].quoted == part.quoted:
            merged[-1] = Literal(merged[-1].text + part.text, part.quoted)
        else:
            merged.append(part)
    return merged


