"""The calculator tool's language: integer arithmetic, parsed strictly (never `eval`).

    expr   := term (("+" | "-") term)*
    term   := unary ("*" unary)*
    unary  := "-" unary | atom
    atom   := NUMBER | "(" expr ")"
    NUMBER := "0" | [1-9][0-9]{0,17}

Spaces may separate tokens. Anything else — another character, a leading zero, an empty
expression, unbalanced parentheses, input longer than MAX_CHARS, nesting deeper than MAX_DEPTH,
a value beyond ±MAX_VALUE — raises `CalcError` naming the position. Evaluation is exact integer
arithmetic (Python ints, bounded by MAX_VALUE at every step so no input can make it slow).
"""

from __future__ import annotations

from reel.bus.errors import ReelError

MAX_CHARS = 200
MAX_DEPTH = 32
MAX_VALUE = 10**18
_DIGITS = "0123456789"


class CalcError(ReelError, ValueError):
    """An expression outside the grammar or the limits; the message names the position."""


def evaluate(text: str) -> int:
    """The value of `text`, or CalcError."""
    if len(text) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    parser = _Parser(text)
    value = parser.expr(depth=0)
    parser.skip_spaces()
    if parser.pos != len(text):
        raise parser.error("unexpected")
    return value


class _Parser:
    """Recursive descent over `text`; `pos` is the next unread character."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def error(self, what: str) -> CalcError:
        if self.pos >= len(self.text):
            return CalcError(f"{what} end of expression at position {self.pos}")
        return CalcError(f"{what} {self.text[self.pos]!r} at position {self.pos}")

    def skip_spaces(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] == " ":
            self.pos += 1

    def peek(self) -> str:
        self.skip_spaces()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def expr(self, depth: int) -> int:
        value = self.term(depth)
        while (op := self.peek()) in ("+", "-"):
            self.pos += 1
            right = self.term(depth)
            value = _bounded(value + right if op == "+" else value - right, self)
        return value

    def term(self, depth: int) -> int:
        value = self.unary(depth)
        while self.peek() == "*":
            self.pos += 1
            value = _bounded(value * self.unary(depth), self)
        return value

    def unary(self, depth: int) -> int:
        if self.peek() == "-":
            self.pos += 1
            if depth + 1 > MAX_DEPTH:
                raise self.error(f"nesting deeper than {MAX_DEPTH} at")
            return -self.unary(depth + 1)
        return self.atom(depth)

    def atom(self, depth: int) -> int:
        char = self.peek()
        if char == "(":
            if depth + 1 > MAX_DEPTH:
                raise self.error(f"nesting deeper than {MAX_DEPTH} at")
            self.pos += 1
            value = self.expr(depth + 1)
            if self.peek() != ")":
                raise self.error("expected ')', found")
            self.pos += 1
            return value
        if char == "" or char not in _DIGITS:
            raise self.error("expected a number or '(', found")
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] in _DIGITS:
            self.pos += 1
        literal = self.text[start:self.pos]
        if len(literal) > 1 and literal[0] == "0":
            self.pos = start
            raise self.error("leading zero")
        if len(literal) > 18:
            self.pos = start
            raise self.error("number longer than 18 digits")
        return int(literal)


def _bounded(value: int, parser: _Parser) -> int:
    if abs(value) > MAX_VALUE:
        raise CalcError(f"value beyond ±{MAX_VALUE} before position {parser.pos}")
    return value
