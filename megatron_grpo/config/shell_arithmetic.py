"""bash's integer arithmetic, `$(( ))`, as far as launch scripts use it."""
from __future__ import annotations

import re
from typing import Callable

from megatron_grpo.config.shell_words import NAME, Unreadable


class _Expression:
    """bash's integer arithmetic, as far as launch scripts use it: + - * / % **, parentheses,
    unary signs, comparisons; division truncates toward zero, as in C."""

    _TOKEN = re.compile(r"\s*(0[xX][0-9a-fA-F]+|\d+|[A-Za-z_][A-Za-z0-9_]*|\*\*|<=|>=|==|!=|&&|\|\||[-+*/%()<>!])")

    def __init__(self, text: str, variable: Callable[[str], int], line: int):
        self.text, self.variable, self.line = text, variable, line
        self.tokens, pos = [], 0
        while pos < len(text):
            if text[pos:].strip() == "":
                break
            match = self._TOKEN.match(text, pos)
            if match is None:
                raise Unreadable(line, f"$(({text})): {text[pos:].strip()!r} is not read here")
            self.tokens.append(match.group(1))
            pos = match.end()
        self.k = 0

    def value(self) -> int:
        if not self.tokens:
            return 0
        result = self.binary(0)
        if self.k != len(self.tokens):
            raise Unreadable(self.line, f"$(({self.text})): unexpected {self.tokens[self.k]!r}")
        return result

    _LEVELS = [("||",), ("&&",), ("==", "!="), ("<", "<=", ">", ">="), ("+", "-"), ("*", "/", "%")]

    def binary(self, level: int) -> int:
        if level == len(self._LEVELS):
            return self.power()
        left = self.binary(level + 1)
        while self.k < len(self.tokens) and self.tokens[self.k] in self._LEVELS[level]:
            op = self.tokens[self.k]
            self.k += 1
            right = self.binary(level + 1)
            if op in ("/", "%") and right == 0:
                raise Unreadable(self.line, f"$(({self.text})): division by 0")
            left = _apply(op, left, right)
        return left

    def power(self) -> int:
        base = self.unary()
        if self.k < len(self.tokens) and self.tokens[self.k] == "**":
            self.k += 1
            return base ** self.power()
        return base

    def unary(self) -> int:
        if self.k >= len(self.tokens):
            raise Unreadable(self.line, f"$(({self.text})): the expression ends early")
        token = self.tokens[self.k]
        self.k += 1
        if token in ("-", "+", "!"):
            operand = self.unary()
            return -operand if token == "-" else (int(not operand) if token == "!" else operand)
        if token == "(":
            result = self.binary(0)
            if self.k >= len(self.tokens) or self.tokens[self.k] != ")":
                raise Unreadable(self.line, f"$(({self.text})): a ( is not closed")
            self.k += 1
            return result
        if token[0].isdigit():  # 0x1f hexadecimal, 017 octal, as in bash
            base = 16 if token[:2].lower() == "0x" else 8 if len(token) > 1 and token[0] == "0" else 10
            try:
                return int(token, base)
            except ValueError:
                raise Unreadable(self.line, f"$(({self.text})): {token} is not a number") from None
        if NAME.fullmatch(token):
            return self.variable(token)
        raise Unreadable(self.line, f"$(({self.text})): unexpected {token!r}")




def _apply(op: str, left: int, right: int) -> int:
    if op in ("/", "%"):  # C's division: the quotient truncates toward zero, the remainder takes left's sign
        quotient = abs(left) // abs(right) * (1 if (left >= 0) == (right >= 0) else -1)
        return quotient if op == "/" else left - right * quotient
    results = {"||": bool(left) or bool(right), "&&": bool(left) and bool(right), "==": left == right,
               "!=": left != right, "<": left < right, "<=": left <= right, ">": left > right, ">=": left >= right,
               "+": left + right, "-": left - right, "*": left * right}
    return int(results[op])


def evaluate(text: str, variable: Callable[[str], int], line: int) -> int:
    """The value of `$((text))` ($-expansions already done); `variable(name)` gives a bare name's value.
    Unreadable (naming the expression) when it is not read here."""
    return _Expression(text, variable, line).value()
