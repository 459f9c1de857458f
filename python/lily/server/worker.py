"""The engine thread: generation runs here, apart from the sockets.

Requests hand it jobs through a queue; one thread runs them one at a time (the engine holds one
sequence), each as an iterator it advances one token at a time. Between tokens it checks whether the
job was cancelled (its client went away, or stopped reading), so a cancelled generation stops within
one decode step. Each job's events reach its request through a bounded buffer that the engine thread
never waits on: a reader that falls behind by more than ``max_buffered`` events is cancelled rather
than allowed to hold the engine.

This is the seam for a batching scheduler (many sequences per engine step): it would take the same
jobs and step several of them per engine call; requests only see ``submit`` and the job's events.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from lily.server.errors import ApiError

__all__ = ["HEARTBEAT", "EngineWorker", "Job"]

_END = object()
#: yielded by ``Job.events(heartbeat=...)`` when nothing happened for that long (a cue to send a ping)
HEARTBEAT = object()


class Failed:
    """An exception raised on the engine thread, delivered to the request as an event."""

    def __init__(self, error: BaseException):
        self.error = error


class Job:
    """One generation: ``run()`` is called on the engine thread and returns an iterator of events."""

    def __init__(self, run: Callable[[], Iterator[Any]], loop: asyncio.AbstractEventLoop, max_buffered: int):
        self.run, self.loop, self.max_buffered = run, loop, max_buffered
        self._buffer: collections.deque[Any] = collections.deque()
        self._lock = threading.Lock()
        self._ready = asyncio.Event()
        self._cancel = threading.Event()
        self.cancel_reason: str | None = None
        self.steps = 0  # events produced so far (read by tests and logs)

    # ---- either side

    def cancel(self, reason: str) -> None:
        """Stop the generation at its next step (or before it starts)."""
        if not self._cancel.is_set():
            self.cancel_reason = reason
            self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    # ---- the engine thread

    def _put(self, item: Any, *, force: bool = False) -> bool:
        """Queue ``item`` for the request; False (and nothing queued) when the buffer is full."""
        with self._lock:
            if not force and len(self._buffer) >= self.max_buffered:
                return False
            self._buffer.append(item)
        try:
            self.loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            self.cancel("server stopping")
        return True

    def _execute(self) -> None:
        iterator: Iterator[Any] | None = None
        try:
            if not self.cancelled:
                iterator = self.run()
                for event in iterator:
                    self.steps += 1
                    if self.cancelled:
                        break
                    if not self._put(event):
                        self.cancel("the client is not reading its stream")
                        break
        except BaseException as e:  # delivered to the request, which decides the status
            self._put(Failed(e), force=True)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as e:  # the generator's cleanup failed: report it rather than lose it
                    self._put(Failed(e), force=True)
            self._put(_END, force=True)

    # ---- the request's event loop

    async def events(self, heartbeat: float | None = None) -> AsyncIterator[Any]:
        """The job's events as they come; an exception from the engine thread is raised here. With
        ``heartbeat``, ``HEARTBEAT`` comes whenever that many seconds pass without an event."""
        while True:
            if heartbeat is None:
                await self._ready.wait()
            else:
                try:
                    await asyncio.wait_for(self._ready.wait(), heartbeat)
                except asyncio.TimeoutError:
                    yield HEARTBEAT
                    continue
            with self._lock:
                items = list(self._buffer)
                self._buffer.clear()
                self._ready.clear()
            for item in items:
                if item is _END:
                    return
                if isinstance(item, Failed):
                    raise item.error
                yield item


class EngineWorker:
    """One thread that runs jobs in order. ``max_waiting`` bounds the queue (more is a 503)."""

    def __init__(self, *, max_waiting: int = 256, max_buffered: int = 512):
        self.max_waiting, self.max_buffered = max_waiting, max_buffered
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._current: Job | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="lily-engine", daemon=True)
        self._thread.start()

    def submit(self, run: Callable[[], Iterator[Any]]) -> Job:
        """Queue a generation; call from the event loop. Its events: ``job.events()``."""
        if self._queue.qsize() >= self.max_waiting:
            raise ApiError(f"{self.max_waiting} requests are already waiting for the model; try again later",
                           status=503, type="server_error", code="overloaded")
        job = Job(run, asyncio.get_running_loop(), self.max_buffered)
        self._queue.put(job)
        return job

    def close(self) -> None:
        """Cancel the running and waiting jobs and end the thread."""
        self._closing = True
        current = self._current
        if current is not None:
            current.cancel("server stopping")
        self._queue.put(None)
        self._thread.join(timeout=30)

    @property
    def busy(self) -> bool:
        return self._current is not None

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if self._closing:
                job.cancel("server stopping")
            self._current = job
            try:
                job._execute()
            finally:
                self._current = None
