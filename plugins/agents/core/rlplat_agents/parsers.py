"""Tool-call parsers (kind ``tool_parser``). Built-in: ``hermes``."""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

from rlplat.contracts.agent import ParsedTurn, ToolCall, ToolCallParser


class HermesParser(ToolCallParser):
    """The Hermes format of Qwen2.5-style chat templates: each call is a JSON object
    ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; the text around
    the calls is the turn's content. ``arguments`` may also be a JSON string holding the object."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        calls, errors = [], []
        for number, match in enumerate(self.CALL.finditer(text)):
            call, error = self.read_call(match.group(1), number)
            if call is not None:
                calls.append(call)
            else:
                errors.append(error)
        rest = self.CALL.sub("", text)
        if self.OPEN in rest:
            errors.append(f"{self.OPEN} without a closing {self.CLOSE}")
            rest = rest.split(self.OPEN, 1)[0]
        return ParsedTurn(rest.replace(self.CLOSE, "").strip(), tuple(calls), tuple(errors))

    def read_call(self, body: str, number: int) -> tuple[ToolCall | None, str]:
        where = f"tool call {number + 1}"
        try:
            value = json.loads(body.strip())
        except json.JSONDecodeError as error:
            return None, f"{where} is not valid JSON ({error.msg} at character {error.pos}): {body.strip()[:200]}"
        if not isinstance(value, dict):
            return None, f"{where} must be a JSON object with 'name' and 'arguments', got {type(value).__name__}"
        name = value.get("name")
        if not isinstance(name, str) or not name:
            return None, f"{where} has no 'name' (a string)"
        arguments: Any = value.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                return None, f"{where} ({name}): 'arguments' is a string that is not JSON"
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return None, f"{where} ({name}): 'arguments' must be a JSON object, got {type(arguments).__name__}"
        return ToolCall(name, arguments), ""

    def format(self, calls: Sequence[ToolCall], content: str = "") -> str:
        parts = [content] if content else []
        for call in calls:
            body = json.dumps({"name": call.name, "arguments": dict(call.arguments)}, ensure_ascii=False)
            parts.append(f"{self.OPEN}\n{body}\n{self.CLOSE}")
        return "\n".join(parts)
