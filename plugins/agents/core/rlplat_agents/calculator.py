"""Arithmetic for the built-in ``calculator`` tool, by parsing: no ``eval``, ``exec`` or ``compile``.

:func:`evaluate` reads the expression with a small recursive-descent parser into a tree of numbers and
operators, then computes it. Only these are understood:

- numbers: integers (``42``), decimals (``3.25``, ``.5``, ``5.``) and decimal exponents (``1.5e3``);
- binary ``+ - * / // % **`` with Python's precedence and results (``7 / 2`` is ``3.5``, ``7 // 2``
  is ``3``, ``-7 % 3`` is ``2``, ``-2 ** 2`` is ``-4``, ``2 ** 3 ** 2`` is ``512``);
- ``^`` as a second spelling of ``**`` (what people mean when they type ``2^10``; Python's XOR is
  not offered);
- unary ``+`` and ``-``, parentheses and whitespace.

Anything else (names, calls, attribute access, strings, ``lambda``) is a syntax error. Integers stay
exact; an operation with a float gives a float.

Resource guards, each a :class:`CalculatorError` raised before the expensive work: an expression longer
than :data:`MAX_EXPRESSION_LENGTH` characters, parentheses or unary signs nested deeper than
:data:`MAX_NESTING_DEPTH`, an integer result of more than :data:`MAX_INTEGER_BITS` bits (``9**9**9`` is
refused from the exponent's size, without computing it), and a float result that overflows or is not
finite. :func:`format_number` gives the text a model sees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

Number = Union[int, float]

MAX_EXPRESSION_LENGTH = 1000
"""Longest expression accepted, in characters."""

MAX_NESTING_DEPTH = 100
"""Deepest nesting of parentheses and unary signs accepted."""

MAX_INTEGER_BITS = 3322
"""Largest integer result accepted, in bits (about 10**1000)."""

SIGNIFICANT_DIGITS = 10
"""Significant digits :func:`format_number` keeps for a float."""


class CalculatorError(ValueError):
    """An expression the calculator refuses: malformed, dividing by zero, or too costly.

    ``position`` is the 0-based index in the expression the problem was found at (None when it concerns
    the whole expression)."""

    def __init__(self, problem: str, expression: str, position: int | None = None):
        self.problem = problem
        self.expression = expression
        self.position = position
        if position is None:
            message = problem
        else:
            start = max(0, position - 20)
            excerpt = expression[start : position + 20]
            caret = " " * (position - start + 1) + "^"
            message = f"{problem} at position {position}:\n {excerpt!r}\n{caret}"
        super().__init__(message)


@dataclass(frozen=True)
class _Token:
    kind: str  # "number", "op", "(", ")", "end"
    text: str
    position: int
    value: Number | None = None


@dataclass(frozen=True)
class _Literal:
    value: Number
    position: int


@dataclass(frozen=True)
class _Unary:
    operator: str
    operand: "_Node"
    position: int


@dataclass(frozen=True)
class _Binary:
    operator: str
    left: "_Node"
    right: "_Node"
    position: int


_Node = Union[_Literal, _Unary, _Binary]

_DIGITS = "0123456789"
_OPERATORS = ("**", "//", "+", "-", "*", "/", "%", "^")


def _tokenize(expression: str) -> list[_Token]:
    tokens: list[_Token] = []
    index = 0
    length = len(expression)
    while index < length:
        char = expression[index]
        if char in " \t\r\n":
            index += 1
            continue
        if char in _DIGITS or (char == "." and index + 1 < length and expression[index + 1] in _DIGITS):
            start = index
            while index < length and expression[index] in _DIGITS:
                index += 1
            is_float = False
            if index < length and expression[index] == ".":
                is_float = True
                index += 1
                while index < length and expression[index] in _DIGITS:
                    index += 1
            if index < length and expression[index] in "eE":
                exponent_start = index
                index += 1
                if index < length and expression[index] in "+-":
                    index += 1
                if index >= length or expression[index] not in _DIGITS:
                    raise CalculatorError("malformed exponent in number", expression, exponent_start)
                while index < length and expression[index] in _DIGITS:
                    index += 1
                is_float = True
            text = expression[start:index]
            if index < length and (expression[index].isalnum() or expression[index] in "._"):
                raise CalculatorError(f"unexpected character {expression[index]!r} after number", expression, index)
            value: Number = float(text) if is_float else int(text)
            if isinstance(value, float) and not math.isfinite(value):
                raise CalculatorError("number too large", expression, start)
            tokens.append(_Token("number", text, start, value))
            continue
        operator = next((op for op in _OPERATORS if expression.startswith(op, index)), None)
        if operator is not None:
            tokens.append(_Token("op", "**" if operator == "^" else operator, index))
            index += len(operator)
            continue
        if char in "()":
            tokens.append(_Token(char, char, index))
            index += 1
            continue
        if char.isalpha() or char == "_":
            end = index
            while end < length and (expression[end].isalnum() or expression[end] == "_"):
                end += 1
            raise CalculatorError(
                f"names are not allowed ({expression[index:end]!r}); use numbers and + - * / // % ** ( )",
                expression,
                index,
            )
        raise CalculatorError(f"unexpected character {char!r}", expression, index)
    tokens.append(_Token("end", "", length))
    return tokens


class _Parser:
    """expression := term (('+' | '-') term)*
    term       := unary (('*' | '/' | '//' | '%') unary)*
    unary      := ('+' | '-') unary | power
    power      := primary ('**' unary)?        # right-associative, binds tighter than a sign on its left
    primary    := number | '(' expression ')'
    """

    def __init__(self, expression: str, tokens: list[_Token]):
        self.expression = expression
        self.tokens = tokens
        self.index = 0
        self.depth = 0

    def peek(self) -> _Token:
        return self.tokens[self.index]

    def take(self) -> _Token:
        token = self.tokens[self.index]
        self.index += 1
        return token

    def error(self, problem: str, token: _Token) -> CalculatorError:
        return CalculatorError(problem, self.expression, token.position)

    def parse(self) -> _Node:
        if self.peek().kind == "end":
            raise CalculatorError("empty expression", self.expression, None)
        node = self.expression_()
        token = self.peek()
        if token.kind != "end":
            if token.kind == ")":
                raise self.error("unmatched ')'", token)
            raise self.error(f"expected an operator, found {token.text!r}", token)
        return node

    def enter(self, token: _Token) -> None:
        self.depth += 1
        if self.depth > MAX_NESTING_DEPTH:
            raise self.error(f"expression nested deeper than {MAX_NESTING_DEPTH} levels", token)

    def expression_(self) -> _Node:
        node = self.term()
        while self.peek().kind == "op" and self.peek().text in ("+", "-"):
            token = self.take()
            node = _Binary(token.text, node, self.term(), token.position)
        return node

    def term(self) -> _Node:
        node = self.unary()
        while self.peek().kind == "op" and self.peek().text in ("*", "/", "//", "%"):
            token = self.take()
            node = _Binary(token.text, node, self.unary(), token.position)
        return node

    def unary(self) -> _Node:
        token = self.peek()
        if token.kind == "op" and token.text in ("+", "-"):
            self.take()
            self.enter(token)
            operand = self.unary()
            self.depth -= 1
            return _Unary(token.text, operand, token.position)
        return self.power()

    def power(self) -> _Node:
        base = self.primary()
        if self.peek().kind == "op" and self.peek().text == "**":
            token = self.take()
            self.enter(token)
            exponent = self.unary()
            self.depth -= 1
            return _Binary("**", base, exponent, token.position)
        return base

    def primary(self) -> _Node:
        token = self.take()
        if token.kind == "number":
            assert token.value is not None
            return _Literal(token.value, token.position)
        if token.kind == "(":
            self.enter(token)
            node = self.expression_()
            self.depth -= 1
            closing = self.take()
            if closing.kind != ")":
                if closing.kind == "end":
                    raise self.error("'(' is never closed", token)
                raise self.error(f"expected ')', found {closing.text!r}", closing)
            return node
        if token.kind == "end":
            raise self.error("expression ends where a number was expected", token)
        raise self.error(f"expected a number or '(', found {token.text!r}", token)


def _check_result(value: Number, expression: str, position: int) -> Number:
    if isinstance(value, complex):
        raise CalculatorError("result is a complex number (fractional power of a negative number)", expression, position)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CalculatorError("result is too large", expression, position)
    elif value.bit_length() > MAX_INTEGER_BITS:
        raise CalculatorError(f"result has more than {MAX_INTEGER_BITS} bits", expression, position)
    return value


def _power(base: Number, exponent: Number, expression: str, position: int) -> Number:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        # |base| ** exponent has at least exponent * (bit_length - 1) bits: refuse before computing it.
        if exponent * (abs(base).bit_length() - 1) > MAX_INTEGER_BITS:
            raise CalculatorError(f"result has more than {MAX_INTEGER_BITS} bits", expression, position)
    return base**exponent


def _compute(node: _Node, expression: str) -> Number:
    if isinstance(node, _Literal):
        return node.value
    if isinstance(node, _Unary):
        operand = _compute(node.operand, expression)
        return -operand if node.operator == "-" else +operand
    left = _compute(node.left, expression)
    right = _compute(node.right, expression)
    operator = node.operator
    try:
        if operator == "+":
            value = left + right
        elif operator == "-":
            value = left - right
        elif operator == "*":
            value = left * right
        elif operator == "/":
            value = left / right
        elif operator == "//":
            value = left // right
        elif operator == "%":
            value = left % right
        else:
            value = _power(left, right, expression, node.position)
    except ZeroDivisionError:
        problem = "zero raised to a negative power" if operator == "**" else "division by zero"
        raise CalculatorError(problem, expression, node.position) from None
    except OverflowError:
        raise CalculatorError("result is too large", expression, node.position) from None
    return _check_result(value, expression, node.position)


def evaluate(expression: str) -> Number:
    """The value of the arithmetic ``expression`` (see the module docstring for what is understood).

    Raises :class:`CalculatorError` naming the problem and its position for malformed input, names or
    calls, division by zero, and expressions or results past the resource guards."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}", repr(expression))
    if len(expression) > MAX_EXPRESSION_LENGTH:
        raise CalculatorError(
            f"expression has {len(expression)} characters; at most {MAX_EXPRESSION_LENGTH} are accepted", expression[:40]
        )
    tree = _Parser(expression, _tokenize(expression)).parse()
    return _compute(tree, expression)


def format_number(value: Number) -> str:
    """The text a model sees for ``value``: an integer in full, a float with up to
    :data:`SIGNIFICANT_DIGITS` significant digits and without a trailing ``.0`` (``2.0`` -> ``"2"``,
    ``1/3`` -> ``"0.3333333333"``, ``0.1 + 0.2`` -> ``"0.3"``, ``1e20`` -> ``"1e+20"``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"format_number takes an int or a float, got {type(value).__name__}")
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    text = format(value, f".{SIGNIFICANT_DIGITS}g")
    return "0" if text == "-0" else text
