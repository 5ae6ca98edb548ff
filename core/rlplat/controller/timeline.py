"""Spans of the run timeline (``trainer.profile``): what each process did when, on one clock.

Every process records its own spans while recording is on (:func:`start` .. :func:`stop`): the driver its
phases, a worker process each remote method call (:meth:`WorkerHost.call`), and any code inside them what it
wraps in :func:`span`. Times are Unix wall-clock seconds (``time.time()``), the one clock every process of a
machine shares (across machines, as close as their clocks are kept). Off, a span costs one global lookup.

:func:`chrome_trace` writes the spans of all processes as Chrome-trace / Perfetto JSON: complete events
(``"ph": "X"``, microseconds), one ``pid`` per process named by a metadata event, instant events (``"ph": "i"``)
for what happened at a moment (the run sentinel's reports). Open it in https://ui.perfetto.dev or
chrome://tracing.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Iterable, Iterator, Mapping

_spans: list[dict[str, Any]] | None = None
_lock = threading.Lock()


def recording() -> bool:
    return _spans is not None


def start() -> None:
    """Record spans in this process from now on (idempotent)."""
    global _spans
    with _lock:
        if _spans is None:
            _spans = []


def stop() -> list[dict[str, Any]]:
    """Stop recording; the spans recorded since :func:`start` (none when it was not on)."""
    global _spans
    with _lock:
        spans, _spans = _spans or [], None
    return spans


@contextlib.contextmanager
def span(name: str, category: str = "phase", **args: Any) -> Iterator[None]:
    """Record the time the block takes as a span ``name`` of this process and thread (when recording)."""
    if _spans is None:
        yield
        return
    started = time.time()
    try:
        yield
    finally:
        record(name, started, time.time(), category, **args)


def record(name: str, started: float, ended: float, category: str = "phase", **args: Any) -> None:
    """Record a span that was timed elsewhere (``started`` and ``ended`` from ``time.time()``)."""
    with _lock:
        if _spans is not None:
            _spans.append({"name": name, "cat": category, "start": started, "end": ended, "pid": os.getpid(),
                           "tid": threading.get_ident(), "args": args})


def chrome_trace(spans: Iterable[Mapping[str, Any]], process_names: Mapping[int, str],
                 instants: Iterable[Mapping[str, Any]] = (), metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The Chrome-trace JSON object of ``spans`` (from any processes), their processes named by
    ``process_names`` (pid -> name), and ``instants`` (dicts with ``name``, ``time`` and ``args``, drawn on the
    first process's track)."""
    spans = sorted(spans, key=lambda item: (item["pid"], item["start"], -item["end"]))
    origin = min((item["start"] for item in spans), default=0.0)
    threads: dict[tuple[int, int], int] = {}
    events: list[dict[str, Any]] = []
    for pid, name in process_names.items():
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
    for item in spans:
        tid = threads.setdefault((item["pid"], item["tid"]), sum(1 for key in threads if key[0] == item["pid"]))
        events.append({"name": item["name"], "cat": item["cat"], "ph": "X", "pid": item["pid"], "tid": tid,
                       "ts": round((item["start"] - origin) * 1e6, 3), "dur": round((item["end"] - item["start"]) * 1e6, 3),
                       "args": dict(item.get("args") or {})})
    first = next(iter(process_names), spans[0]["pid"] if spans else 0)
    for item in instants:
        events.append({"name": item["name"], "cat": "sentinel", "ph": "i", "s": "g", "pid": first, "tid": 0,
                       "ts": round((item["time"] - origin) * 1e6, 3), "args": dict(item.get("args") or {})})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"origin_unix_s": origin, **(metadata or {})}}
