"""The calculator tool's arithmetic: Python's results by parsing, clear errors, bounded cost."""

from __future__ import annotations

import random
import time

import pytest

from rlplat_agents.calculator import (
    MAX_EXPRESSION_LENGTH,
    MAX_INTEGER_BITS,
    MAX_NESTING_DEPTH,
    CalculatorError,
    evaluate,
    format_number,
)


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("1 + 2", 3),
        ("7 - 10", -3),
        ("6 * 7", 42),
        ("7 / 2", 3.5),
        ("8 / 2", 4.0),
        ("7 // 2", 3),
        ("-7 // 2", -4),
        ("7 % 3", 1),
        ("-7 % 3", 2),
        ("2 ** 10", 1024),
        ("2 ^ 10", 1024),
        ("2 ** -1", 0.5),
        ("3.25 + .75", 4.0),
        ("5. * 2", 10.0),
        ("1.5e3", 1500.0),
        ("2E-2", 0.02),
        ("  ( 1 + 2 ) * 3  ", 9),
        ("((((4))))", 4),
        ("--3", 3),
        ("+-+3", -3),
        ("12345678901234567890 * 98765432109876543210", 12345678901234567890 * 98765432109876543210),
        ("0.1 + 0.2", 0.1 + 0.2),
        ("7.5 // 2", 3.0),
        ("7.5 % 2", 1.5),
        ("\t1\n+\r2", 3),
    ],
)
def test_values_of_simple_expressions(expression, expected):
    value = evaluate(expression)
    assert value == expected
    assert type(value) is type(expected)


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("1 + 2 * 3", 7),  # * before +
        ("(1 + 2) * 3", 9),
        ("10 - 4 - 3", 3),  # left-associative
        ("100 / 10 / 5", 2.0),
        ("2 ** 3 ** 2", 512),  # right-associative
        ("-2 ** 2", -4),  # ** binds tighter than a sign on its left
        ("2 ** -2 ** 2", 2 ** -(2**2)),  # ... and a sign on its right belongs to the exponent
        ("(-2) ** 2", 4),
        ("2 * 3 ** 2", 18),
        ("-3 % 5 * 2", 4),  # (-3 % 5) * 2
        ("2 ^ 3 ^ 2", 512),
        ("1 - -1", 2),
    ],
)
def test_precedence_and_associativity_follow_python(expression, expected):
    assert evaluate(expression) == expected


def random_expression(rng: random.Random, depth: int) -> str:
    if depth == 0 or rng.random() < 0.3:
        if rng.random() < 0.7:
            return str(rng.randint(0, 50))
        return f"{rng.randint(0, 50)}.{rng.randint(0, 99):02d}"
    form = rng.random()
    if form < 0.15:
        return f"-{random_expression(rng, depth - 1)}"
    if form < 0.3:
        return f"({random_expression(rng, depth - 1)})"
    operator = rng.choice(["+", "-", "*", "/", "//", "%", "**"])
    if operator == "**":
        # A parenthesised base and a small integer exponent keep values small and real.
        return f"({random_expression(rng, depth - 1)}) ** {rng.randint(-3, 4)}"
    return f"{random_expression(rng, depth - 1)} {operator} {random_expression(rng, depth - 1)}"


def test_agrees_with_python_on_generated_expressions():
    rng = random.Random(15)
    compared = refused = 0
    for _ in range(3000):
        text = random_expression(rng, 4)
        try:
            expected = eval(text, {"__builtins__": {}})  # the reference: Python's own arithmetic on our generated text
        except (ZeroDivisionError, OverflowError):
            with pytest.raises(CalculatorError):
                evaluate(text)
            refused += 1
            continue
        value = evaluate(text)
        assert type(value) is type(expected), text
        assert value == expected, text  # the same operations in the same order: exactly equal
        compared += 1
    assert compared > 2000 and refused > 10


@pytest.mark.parametrize(
    "expression, problem, position",
    [
        ("1 / 0", "division by zero", 2),
        ("1 // 0", "division by zero", 2),
        ("5 % 0", "division by zero", 2),
        ("1.5 / (2 - 2)", "division by zero", 4),
        ("0 ** -1", "zero raised to a negative power", 2),
        ("", "empty expression", None),
        ("   ", "empty expression", None),
        ("1 +", "expression ends where a number was expected", 3),
        ("(1 + 2", "'(' is never closed", 0),
        ("1 + 2)", "unmatched ')'", 5),
        ("1 2", "expected an operator, found '2'", 2),
        ("2 * * 3", "expected a number or '(', found '*'", 4),
        ("()", "expected a number or '(', found ')'", 1),
        ("1.2.3", "unexpected character '.' after number", 3),
        ("1e", "malformed exponent in number", 1),
        ("3 & 1", "unexpected character '&'", 2),
        ("'a'", "unexpected character", 0),
        ("2 ** 0.5 * (-8) ** 0.5", "complex", 16),
    ],
)
def test_errors_name_the_problem_and_position(expression, problem, position):
    with pytest.raises(CalculatorError) as caught:
        evaluate(expression)
    assert problem in caught.value.problem
    assert caught.value.position == position
    if position is not None:
        assert f"at position {position}" in str(caught.value)


def test_an_error_is_a_value_error():
    with pytest.raises(ValueError):
        evaluate("1/0")


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('true')",
        "os.getcwd()",
        "x",
        "abs(-1)",
        "(1).__class__",
        "1 .real",
        "lambda: 1",
        "[1, 2]",
        "1 if 1 else 2",
        "1 < 2",
        "1; 2",
        "0x10",
        "1_000",
        "1j",
        "True + 1",
        "2 ＋ 2",
        "²",
    ],
)
def test_anything_but_arithmetic_is_refused(expression):
    with pytest.raises(CalculatorError):
        evaluate(expression)


def test_names_are_reported_as_names():
    with pytest.raises(CalculatorError, match=r"names are not allowed \('__import__'\)") as caught:
        evaluate("1 + __import__('os')")
    assert caught.value.position == 4


def timed(expression: str) -> tuple[float, CalculatorError]:
    start = time.perf_counter()
    with pytest.raises(CalculatorError) as caught:
        evaluate(expression)
    return time.perf_counter() - start, caught.value


@pytest.mark.parametrize(
    "expression, problem",
    [
        ("9**9**9", f"more than {MAX_INTEGER_BITS} bits"),
        ("9^9^9", f"more than {MAX_INTEGER_BITS} bits"),
        ("2 ** 100000000000", f"more than {MAX_INTEGER_BITS} bits"),
        ("(10 ** 900) * (10 ** 900)", f"more than {MAX_INTEGER_BITS} bits"),
        ("1.5 ** 100000", "result is too large"),
        ("2.0 ** 10 ** 100", "result is too large"),
        ("1e308 * 10", "result is too large"),
        ("10 ** 400 * 1.0", "result is too large"),
        ("1e999", "number too large"),
        ("(" * (MAX_NESTING_DEPTH + 1) + "1" + ")" * (MAX_NESTING_DEPTH + 1), "nested deeper"),
        ("-" * (MAX_NESTING_DEPTH + 1) + "1", "nested deeper"),
        ("1+" * 600 + "1", "characters; at most"),
    ],
)
def test_costly_expressions_are_refused_quickly(expression, problem):
    seconds, error = timed(expression)
    assert problem in error.problem
    assert seconds < 0.05


def test_the_guards_leave_room_for_ordinary_big_numbers():
    assert evaluate("2 ** 1000") == 2**1000
    assert evaluate("1 ** (10 ** 100)") == 1
    assert evaluate("(-1) ** (10 ** 100 + 1)") == -1
    assert evaluate("0.5 ** 10000") == 0.0
    assert evaluate("(" * MAX_NESTING_DEPTH + "1" + ")" * MAX_NESTING_DEPTH) == 1
    assert evaluate(" " * (MAX_EXPRESSION_LENGTH - 1) + "1") == 1


def test_a_non_string_is_refused():
    with pytest.raises(CalculatorError, match="must be a string, got int"):
        evaluate(12)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "value, text",
    [
        (42, "42"),
        (-7, "-7"),
        (2**100, "1267650600228229401496703205376"),
        (2.0, "2"),
        (3.5, "3.5"),
        (1 / 3, "0.3333333333"),
        (2 / 3, "0.6666666667"),
        (0.1 + 0.2, "0.3"),
        (1e20, "1e+20"),
        (1.5e-7, "1.5e-07"),
        (-0.0, "0"),
        (123456789012.0, "1.23456789e+11"),
    ],
)
def test_format_number(value, text):
    assert format_number(value) == text


def test_format_number_of_an_evaluation():
    assert format_number(evaluate("10 / 4")) == "2.5"
    assert format_number(evaluate("10 / 5")) == "2"


def test_format_number_refuses_other_types():
    with pytest.raises(TypeError, match="got str"):
        format_number("1")  # type: ignore[arg-type]


def test_the_module_never_calls_eval_exec_or_compile():
    import ast
    import inspect

    import rlplat_agents.calculator as calculator

    tree = ast.parse(inspect.getsource(calculator))
    called = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert called.isdisjoint({"eval", "exec", "compile", "__import__", "getattr"})
    assert "evaluate" not in called and "_compute" in called  # the walk above does see calls
