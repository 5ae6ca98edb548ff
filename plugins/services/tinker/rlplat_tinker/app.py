"""The HTTP routes of the Tinker API (``/api/v1/...``) over :class:`~rlplat_tinker.service.TinkerService`, served
with aiohttp. JSON in and out, except ``forward_backward``'s body and the results of ``forward_backward``,
``forward`` and ``sample``, which are the SDK's protobuf messages (:mod:`rlplat_tinker.wire`).

Auth: the ``X-API-Key`` header. With keys configured a request without one of them is refused (401), and
everything a key creates (sessions, training clients, saved states, sampler weights, futures) is visible to that
key only: another key gets 404, as for something that does not exist. Without keys (loopback only) every caller
is the one local user. A refused request gets a 4xx with ``{"detail": reason}``; a call that fails after it was
accepted gets its future's ``{"error": reason, "category": "user" | "server"}``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import hmac
import json
import logging
from typing import Any, Awaitable, Callable, Optional, Sequence

from aiohttp import web

from rlplat_tinker import wire
from rlplat_tinker.losses import RequestError
from rlplat_tinker.service import TinkerService

LOCAL_USER = "local"
#: how long a ``retrieve_future`` waits for its result before answering 408 (the SDK asks again at once; its own
#: timeout for one poll is 45 s)
POLL_WAIT_S = 20.0
PROTOBUF = "application/x-protobuf"
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": False, "proto_compress_fwdbwd": False,
                 "use_pyqwest_transport": False}

log = logging.getLogger("rlplat.serve")


def owner_of(request: web.Request, keys: Sequence[str]) -> str:
    given = request.headers.get("X-API-Key", "")
    if not keys:
        return LOCAL_USER
    for key in keys:
        if hmac.compare_digest(given.encode(), key.encode()):
            return "key:" + hashlib.sha256(key.encode()).hexdigest()  # owners are written into saved states: no key in clear
    raise web.HTTPUnauthorized(text=json.dumps({"detail": "a valid X-API-Key header is required"}), content_type="application/json")


def build_app(service: TinkerService, keys: Sequence[str] = ()) -> web.Application:
    routes = web.RouteTableDef()

    async def body_of(request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestError("the body is not JSON") from None
        if not isinstance(body, dict):
            raise RequestError("the body is not a JSON object")
        return body

    def json_route(path: str, handler: Callable[[str, dict], Any]) -> None:
        @routes.post(path)
        async def route(request: web.Request) -> web.Response:
            owner = owner_of(request, keys)
            return web.json_response(handler(owner, await body_of(request)))

    def future_route(path: str, submit: Callable[[str, dict], str]) -> None:
        json_route(path, lambda owner, body: {"request_id": submit(owner, body), "model_id": body.get("model_id")})

    json_route("/api/v1/client/config", lambda owner, body: CLIENT_CONFIG)
    json_route("/api/v1/client/dynamic_config", lambda owner, body: {})
    json_route("/api/v1/create_session", lambda owner, body: {"session_id": service.create_session(owner), "type": "create_session"})
    json_route("/api/v1/session_heartbeat", lambda owner, body: {"type": "session_heartbeat"})
    json_route("/api/v1/telemetry", lambda owner, body: {"status": "accepted"})
    json_route("/api/v1/get_info", lambda owner, body: service.get_info(owner, body.get("model_id")))
    json_route("/api/v1/create_sampling_session", service.create_sampling_session)
    future_route("/api/v1/create_model", service.create_model)
    future_route("/api/v1/unload_model", lambda owner, body: service.unload(owner, body.get("model_id")))
    future_route("/api/v1/optim_step", service.optim_step)
    future_route("/api/v1/save_weights", service.save_state)
    future_route("/api/v1/load_weights", service.load_state)
    future_route("/api/v1/save_weights_for_sampler", service.save_for_sampler)

    @routes.post("/api/v1/sessions/{session}/finish")
    async def finish(request: web.Request) -> web.Response:
        service.check_session(owner_of(request, keys), request.match_info["session"])
        return web.json_response({})

    @routes.get("/api/v1/samplers/{sampler}")
    async def sampler(request: web.Request) -> web.Response:
        return web.json_response(service.sampler(owner_of(request, keys), request.match_info["sampler"]))

    @routes.get("/api/v1/get_server_capabilities")
    async def capabilities(request: web.Request) -> web.Response:
        owner_of(request, keys)
        return web.json_response({"supported_models": [{"model_name": service.base_model, "max_context_length": service.max_context,
                                                         "trainable": True, "sampleable": True}]})

    @routes.get("/api/v1/healthz")
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    @routes.post("/api/v1/forward_backward")
    async def forward_backward(request: web.Request) -> web.Response:
        owner = owner_of(request, keys)
        parsed = wire.read_forward_backward(await request.read(), request.headers.get("Content-Encoding"))
        return web.json_response({"request_id": service.forward_backward(owner, parsed), "model_id": parsed["model_id"]})

    @routes.post("/api/v1/asample")
    async def sample(request: web.Request) -> web.Response:
        request_id, sequence_ids = service.sample(owner_of(request, keys), await body_of(request))
        return web.json_response({"request_id": request_id, "sample_sequence_ids": sequence_ids})

    @routes.post("/api/v1/retrieve_future")
    async def retrieve(request: web.Request) -> web.Response:
        owner = owner_of(request, keys)
        request_id = (await body_of(request)).get("request_id")
        future = service.futures.get(owner, request_id)
        try:
            result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout=POLL_WAIT_S)
        except asyncio.TimeoutError:
            return web.json_response({"type": "try_again", "request_id": request_id, "queue_state": "active"}, status=408)
        except RequestError as error:
            return web.json_response({"error": str(error), "category": "user"})
        except (ValueError, KeyError, FileNotFoundError) as error:
            return web.json_response({"error": f"{type(error).__name__}: {error}", "category": "user"})
        except Exception as error:  # the call failed in the workers: the client gets the reason, the log the traceback
            log.exception("request %s failed", request_id)
            return web.json_response({"error": f"{type(error).__name__}: {error}", "category": "server"})
        if isinstance(result, bytes):
            return web.Response(body=result, content_type=PROTOBUF)
        return web.json_response(result)

    @web.middleware
    async def errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        try:
            return await handler(request)
        except RequestError as error:
            return web.json_response({"detail": str(error)}, status=error.status)
        except (TypeError, AttributeError, ValueError, KeyError) as error:
            # raised while a handler reads the request (the work itself runs in futures): a field of the wrong type
            # or shape, an unhashable id. The client gets 400 with the reason (a 500 the SDK would retry for minutes)
            log.info("bad request to %s: %s: %s", request.path, type(error).__name__, error)
            return web.json_response({"detail": f"malformed request: {type(error).__name__}: {error}"}, status=400)
        except web.HTTPException as error:
            if error.text and error.content_type == "application/json":
                raise
            return web.json_response({"detail": error.reason}, status=error.status)

    app = web.Application(client_max_size=256 << 20, middlewares=[errors])
    app.add_routes(routes)
    return app


class Server:
    """The app on ``host:port`` in a thread of its own (``port`` 0: a free one); :meth:`stop` ends it."""

    def __init__(self, service: TinkerService, host: str = "127.0.0.1", port: int = 0, keys: Sequence[str] = ()):
        self.service, self.host, self.port, self.keys = service, host, port, list(keys)
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.runner: Optional[web.AppRunner] = None
        self.ready: concurrent.futures.Future = concurrent.futures.Future()
        self.thread: Any = None

    def start(self) -> "Server":
        import threading

        self.thread = threading.Thread(target=self.serve, name="rlplat-serve-http", daemon=True)
        self.thread.start()
        self.port = self.ready.result(timeout=60)
        return self

    def serve(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.bind())
        except BaseException as error:
            self.ready.set_exception(error)
            return
        self.loop.run_forever()

    async def bind(self) -> None:
        self.runner = web.AppRunner(build_app(self.service, self.keys), access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port)
        await site.start()
        self.ready.set_result(site._server.sockets[0].getsockname()[1])

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        if self.loop is None:
            return
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop = None
