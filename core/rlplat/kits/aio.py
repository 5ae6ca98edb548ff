"""Running asyncio code from synchronous code, wherever the caller is."""

from __future__ import annotations

import asyncio
from typing import Any


def run_async(coroutine: Any) -> Any:
    """Run ``coroutine`` to completion from synchronous code, also when this thread already runs an
    event loop (a Ray async actor, a notebook): then in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        running = False
    else:
        running = True
    if not running:  # outside the except block: errors of the coroutine are not chained to this lookup
        return asyncio.run(coroutine)
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
