"""An asyncio loop on a daemon thread, as LMCache's remote backend expects
(it schedules connector work on a loop that runs elsewhere)."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest


async def _cancel_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="backend-loop", daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        try:  # cancel what the connectors left running (e.g. their job executors)
            asyncio.run_coroutine_threadsafe(_cancel_tasks(), loop).result(10)
        except Exception:  # noqa: BLE001 - best effort in teardown
            pass
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        if not thread.is_alive():
            loop.close()
