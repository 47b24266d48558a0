"""The `mcp` SDK's own client (ClientSession over stdio_client) driving a real `expr mcp`
process, callable from synchronous test code: the session lives on an event loop in a
thread, each call waits for its answer. The tests and `bench/mcp.py` share it."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any


class Answer:
    """One tool result: its text, the JSON it holds (None for an error) and its flag."""

    def __init__(self, result: Any, seconds: float) -> None:
        self.error = bool(result.is_error)
        self.text = "".join(getattr(c, "text", "") for c in result.content)
        self.json = None if self.error else json.loads(self.text)
        self.seconds = seconds
        self.bytes = len(self.text.encode())


class McpClient:
    """`expr mcp ARGS` started by the SDK's stdio client, a session initialized."""

    def __init__(self, args: Sequence[str], env: Mapping[str, str] | None = None,
                 command: str | None = None, timeout: float = 60) -> None:
        from mcp import StdioServerParameters

        self.params = StdioServerParameters(
            command=command or sys.executable,
            args=[*([] if command else ["-m", "expr_cli.main"]), "mcp", *args],
            env=dict(env or {}))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.session: Any = None
        self.stop: asyncio.Event | None = None
        self.done = asyncio.run_coroutine_threadsafe(self._main(), self.loop)
        deadline = time.monotonic() + timeout
        while self.session is None:
            if self.done.done():
                self.done.result()  # the failure to start
            assert time.monotonic() < deadline, "expr mcp did not start"
            time.sleep(0.02)

    async def _main(self) -> None:
        from mcp import ClientSession
        from mcp.client.stdio import stdio_client

        self.stop = asyncio.Event()
        async with stdio_client(self.params) as (read, write), ClientSession(read, write) as s:
            self.init = await s.initialize()
            self.session = s
            await self.stop.wait()

    def _run(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def tools(self) -> list[Any]:
        """The tools the server lists."""
        return list(self._run(self.session.list_tools(), 60).tools)

    def call(self, name: str, timeout: float = 120, **arguments: Any) -> Answer:
        """Call tool `name`; its answer and how long it took."""
        t0 = time.perf_counter()
        result = self._run(self.session.call_tool(name, arguments), timeout)
        return Answer(result, time.perf_counter() - t0)

    def close(self) -> None:
        """Close stdin (the server exits) and the loop."""
        if self.stop is not None:
            self.loop.call_soon_threadsafe(self.stop.set)
        try:
            self.done.result(30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()

    def __enter__(self) -> McpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
