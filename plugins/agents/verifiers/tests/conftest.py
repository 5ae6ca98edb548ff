"""A scripted policy for the adapter's unit tests: an OpenAI-compatible chat endpoint on 127.0.0.1 that
answers with given replies, standing in for the rollout worker's gateway (no model, no training run)."""

from __future__ import annotations

from typing import Any, Sequence, Union

import pytest

Reply = Union[str, dict]
"""A reply's text, or ``{"status": 400, "message": ..., "code": ...}`` for an OpenAI error answer."""


class ScriptedPolicy:
    """Serves ``POST /v1/chat/completions``: each request gets the next reply; ``requests`` holds their
    JSON bodies. An ``async with`` block serves it on the running event loop."""

    def __init__(self, replies: Sequence[Reply]):
        self.replies, self.requests = list(replies), []
        self.base_url = ""

    async def __aenter__(self) -> "ScriptedPolicy":
        from aiohttp import web

        application = web.Application()
        application.router.add_post("/v1/chat/completions", self.chat)
        self.runner = web.AppRunner(application)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.runner.cleanup()

    async def chat(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.json()
        self.requests.append(body)
        reply = self.replies.pop(0)
        if isinstance(reply, dict):
            error = {"message": reply["message"], "type": "invalid_request_error", "param": None, "code": reply.get("code")}
            return web.json_response({"error": error}, status=reply["status"])
        return web.json_response({
            "id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": reply}}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}})


@pytest.fixture
def scripted_policy():
    """``scripted_policy(replies)``: a :class:`ScriptedPolicy` to serve in an ``async with`` block."""
    return ScriptedPolicy
