"""A black-box agent for the tool demo, written only against the ``openai`` client (the ``tools-blackbox``
demo runs it through the ``blackbox`` agent loop and the worker's gateway).

:func:`calculator_agent` plays the tool demo's task as any OpenAI tool-calling program would: it offers
the calculator's function schema, runs each call the model makes with its own arithmetic (the
expression parsed, never evaluated as Python), sends the result back as a ``tool`` message, and stops
at a turn without calls, after ``max_turns`` model turns, or when the gateway says the token budget
is spent (``context_length_exceeded``). It returns None: the run's reward manager
scores the final answer with the tool demo's scorer, as for the native ``tool`` loop.
"""

from __future__ import annotations

import ast
import json
import operator
from typing import Any, Mapping

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def arithmetic(expression: str) -> str:
    """The value of an integer expression with + - * / and parentheses, as the calculator writes it;
    an error message for anything else."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("only integers, + - * / and parentheses")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as error:
        return f"error: {error}"
    return str(int(result)) if float(result).is_integer() else f"{result:g}"


def calculator_agent(task: Mapping[str, Any], base_url: str, api_key: str, max_turns: int = 2) -> None:
    """One task of the tool demo through an OpenAI endpoint (see the module docstring)."""
    import openai

    from rlplat_demo.tools import TOOL_NAME, TOOL_SCHEMA

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[dict] = [dict(message) for message in task["raw_prompt"]]
    for _ in range(max_turns):
        try:
            reply = client.chat.completions.create(model="policy", messages=messages, tools=[TOOL_SCHEMA])
        except openai.BadRequestError as error:
            if getattr(error, "code", None) == "context_length_exceeded":
                break  # the token budget is spent: the last answer stands, as in the tool loop
            raise
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls or reply.choices[0].finish_reason == "length":
            break
        for call in message.tool_calls:
            if call.function.name != TOOL_NAME:
                result = f"error: there is no tool named {call.function.name!r}"
            else:
                try:
                    arguments = json.loads(call.function.arguments)
                    result = arithmetic(str(arguments["expression"]))
                except (json.JSONDecodeError, KeyError, TypeError) as error:
                    result = f"error: bad arguments: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": result})
    return None
