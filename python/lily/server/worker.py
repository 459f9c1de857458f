"""The engine thread: every generation runs here, apart from the sockets, as one continuous batch.

Requests hand it jobs (each a ``lily.generate`` generation: a generator of chunks and engine requests). The
thread owns the engine; each step it

1. drops the jobs that were cancelled (their client went away or stopped reading): their sequences are freed
   at the next step boundary, which falls between two chunks of a long prefill as well as between tokens;
2. admits waiting jobs in the order they arrived, while fewer than ``max_sequences`` run: each gets its own
   engine sequence, a copy of the longest prefix of its prompt that the model's prefix cache holds (from
   any earlier conversation), and prefills the rest;
3. advances prefills by at most ``max_batch_tokens`` prompt tokens in all, the job whose prefill could end
   soonest first (``prefill_plan``: the fewest tokens left, aged by the steps it has waited), keeping copies in
   the prefix cache where ``PrefixCache.cuts`` says (message starts, every ``snapshot_every`` tokens) and at
   the end of each prompt, each also queued for the disk tier when there is one (only the export runs here; the
   writer thread writes, and a snapshot is skipped rather than queued behind another write);
4. decodes one token of every generating job with one ``decode_batch`` call, and hands each its row of logits.

So a long prompt does not stop the streams already running (they get a token every step) nor the short prompts
that arrive after it (their prefill goes first, then they decode while the long one goes on), and per-request
work (sampling, stop strings, grammars, tool-call parsing) stays in each job's own generation. Each job's
events reach its request through a bounded buffer that the engine thread never waits on: a reader that
falls behind by more than ``max_buffered`` events is cancelled rather than allowed to hold the engine.

Waiting: at most ``max_waiting`` jobs wait for a place in the batch, in arrival order; one more is refused
before any work (``check_room`` / ``submit``: a 429 with a ``Retry-After`` estimated from how often jobs have
been leaving the batch). A waiting job that is cancelled (its client went away) leaves the queue at once: its
generation never starts, and its place goes to the next request. A waiting stream is already open (its
response head is sent) and gets the APIs' pings, so a client waits without timing out.
"""

from __future__ import annotations

import asyncio
import collections
import math
import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable
from typing import Any

from lily._lily import ContextFullError
from lily.generate import Decode, Prefill, Steps
from lily.outputs import Chunk
from lily.server.errors import ApiError

__all__ = ["HEARTBEAT", "Job", "Scheduler"]

_END = object()
#: yielded by ``Job.events(heartbeat=...)`` when nothing happened for that long (a cue to send a ping)
HEARTBEAT = object()


class Failed:
    """An exception raised on the engine thread, delivered to the request as an event."""

    def __init__(self, error: BaseException):
        self.error = error


class Job:
    """One generation: ``run()`` is called on the engine thread and returns its steps
    (``lily.generate.generation``)."""

    def __init__(self, run: Callable[[], Steps], loop: asyncio.AbstractEventLoop, max_buffered: int):
        self.run, self.loop, self.max_buffered = run, loop, max_buffered
        self._buffer: collections.deque[Any] = collections.deque()
        self._lock = threading.Lock()
        self._ready = asyncio.Event()
        self._cancel = threading.Event()
        self._on_cancel: Callable[[Job], None] | None = None  # the scheduler's: a waiting job leaves the queue
        self.cancel_reason: str | None = None
        self.steps = 0  # events produced so far (read by tests and logs)

    # ---- either side

    def cancel(self, reason: str) -> None:
        """Stop the generation at its next step (or before it starts)."""
        if not self._cancel.is_set():
            self.cancel_reason = reason
            self._cancel.set()
            if self._on_cancel is not None:
                self._on_cancel(self)

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




def prefill_plan(prefilling: list[Any], budget: int) -> list[tuple[Any, int]]:
    """How many prompt tokens each prefilling job (``arrived``: the step it joined, ``done`` of its ``ids``)
    advances this step, ``budget`` tokens in all: the job whose prefill could end first had it been given the
    whole budget of every step since it arrived goes first (``arrived * budget + tokens left``), and what it
    leaves of the budget goes to the next. So a short prompt that arrives during a long prefill is served at
    once (its first token comes while the long one is still being prefilled) and a long prompt is never starved:
    a job passed over for k steps gains k * budget on every later arrival, so a prompt of n tokens ends its
    prefill at most about n / budget steps later than it would alone."""
    plan = []
    for r in sorted(prefilling, key=lambda r: r.arrived * budget + len(r.ids) - r.done):
        if budget <= 0:
            break
        n = min(budget, len(r.ids) - r.done)
        plan.append((r, n))
        budget -= n
    return plan


class _Running:
    """A job admitted to the batch: its steps, its engine sequence, how much of its prompt that holds."""

    __slots__ = ("job", "steps", "ids", "seq", "reused", "done", "cuts", "last", "length", "token", "fed", "arrived")

    def __init__(self, job: Job, steps: Steps, ids: list[int], seq: int, reused: int, cuts: list[int],
                 arrived: int = 0, last: int | None = None):
        self.job, self.steps, self.ids, self.seq = job, steps, ids, seq
        self.arrived = arrived  # the scheduler step at which it joined the batch (the prefill order's aging)
        self.reused = reused  # prompt tokens resumed from the prefix cache
        self.done = reused  # prompt tokens in the sequence
        self.cuts = cuts  # where the prefill keeps copies in the prefix cache
        self.last = last  # the cut at the start of the last message, also written to the disk tier
        self.length = reused  # tokens in the sequence
        self.token: int | None = None  # the token to decode at the next step (None: prefilling or finished)
        self.fed: list[int] = []  # generated tokens decoded into the sequence (after the prompt)


class Scheduler:
    """The engine thread over ``model``: at most ``max_sequences`` generations in one batch, the rest waiting
    in arrival order (``max_waiting`` of them; one more is a 429); prefills advance ``max_batch_tokens`` prompt
    tokens per step in all (default: the engine's ``prefill_chunk``), shared as ``prefill_plan`` says."""

    #: Jobs whose departures from the batch estimate a 429's ``Retry-After``, and its bounds in seconds.
    DEPARTURES = 16
    RETRY_AFTER = (1, 60)

    def __init__(self, model: Any, *, max_sequences: int = 4, max_batch_tokens: int | None = None,
                 max_waiting: int = 256, max_buffered: int = 512):
        self.model, self.engine = model, model.engine
        self.cache, self.boundary_id = model.prefix.cache, model.prefix.boundary_id
        chunk = int(self.engine.prefill_chunk)
        if not 1 <= max_sequences <= chunk:  # decode_batch takes at most prefill_chunk rows
            raise ValueError(f"max_sequences must be between 1 and the engine's prefill_chunk ({chunk}), "
                             f"got {max_sequences}")
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be at least 1, got {max_batch_tokens}")
        self.max_sequences, self.max_batch_tokens = max_sequences, max_batch_tokens or chunk
        self.max_waiting, self.max_buffered = max_waiting, max_buffered
        self.max_seq = int(self.engine.max_seq)
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[_Running] = []
        self._wake = threading.Condition()
        self._closing = False
        self._departures: collections.deque[float] = collections.deque(maxlen=self.DEPARTURES)  # monotonic times
        self.steps = 0  # engine steps run (read by tests and logs)
        self._thread = threading.Thread(target=self._loop, name="lily-engine", daemon=True)
        self._thread.start()

    # ---- the event loop's side

    def check_room(self) -> None:
        """Raise the 429 that ``submit`` would raise now (called before a request's prompt is prepared, so that
        a refused request costs no work)."""
        with self._wake:
            if len(self._waiting) >= self.max_waiting:
                raise ApiError(f"{self.max_waiting} requests are already waiting for the model; try again later",
                               status=429, type="rate_limit_error", code="overloaded",
                               headers={"retry-after": str(self.retry_after())})

    def retry_after(self) -> int:
        """Seconds until a place in the queue is likely to free: the mean time between the last jobs leaving the
        batch (each departure lets one waiting job in), within ``RETRY_AFTER``; its lower bound before two left."""
        low, high = self.RETRY_AFTER
        with self._wake:
            times = list(self._departures)
        if len(times) < 2:
            return low
        return max(low, min(high, math.ceil((times[-1] - times[0]) / (len(times) - 1))))

    def submit(self, run: Callable[[], Steps]) -> Job:
        """Queue a generation; call from the event loop. Its events: ``job.events()``."""
        with self._wake:
            self.check_room()
            job = Job(run, asyncio.get_running_loop(), self.max_buffered)
            job._on_cancel = self._withdraw
            self._waiting.append(job)
            self._wake.notify()
        return job

    def _withdraw(self, job: Job) -> None:
        """A cancelled job that is still waiting leaves the queue now, its generation never started."""
        with self._wake:
            if job not in self._waiting:  # admitted already: it leaves the batch at the next step
                return
            self._waiting.remove(job)
        job._put(_END, force=True)

    def close(self) -> None:
        """Cancel the running and waiting jobs and end the thread."""
        with self._wake:
            self._closing = True
            for job in [*self._waiting, *(r.job for r in list(self._running))]:
                job.cancel("server stopping")
            self._wake.notify()
        self._thread.join(timeout=30)
        if self.cache.disk is not None:  # the turn ends queued for the disk tier are written before the server goes
            self.cache.disk.flush()

    @property
    def busy(self) -> bool:
        return bool(self._running or self._waiting)

    @property
    def running(self) -> list[Job]:
        """The jobs in the batch now."""
        return [r.job for r in list(self._running)]  # a copy first: the engine thread changes the list

    @property
    def waiting(self) -> list[Job]:
        """The jobs waiting for a place in the batch, first come first."""
        with self._wake:  # a deque changed while it is copied raises
            return list(self._waiting)

    # ---- the engine thread

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._running and not self._waiting and not self._closing:
                    self._wake.wait()
                if self._closing and not self._running and not self._waiting:
                    return
                admitted = []
                while self._waiting and len(self._running) + len(admitted) < self.max_sequences:
                    admitted.append(self._waiting.popleft())
            with self.model.prefix.turn:  # the prefix cache is shared with the model's other users
                try:
                    for r in [r for r in self._running if r.job.cancelled]:
                        self._finish(r)
                    for job in admitted:
                        self._admit(job)
                    self._step()
                except BaseException as e:  # a bug here: fail the running requests rather than leave them hanging
                    for r in list(self._running):
                        r.job._put(Failed(e), force=True)
                        self._finish(r)

    def _admit(self, job: Job) -> None:
        """Start ``job``: its prompt, and a sequence resumed from the longest cached prefix of it."""
        if job.cancelled:
            job._put(_END, force=True)
            return
        steps: Steps | None = None
        try:
            steps = job.run()
            request = next(steps)
            assert isinstance(request, Prefill), "a generation starts with its prompt"
            ids = request.ids
            entry = self.cache.longest(ids, len(ids))
            reused = entry.length if entry is not None else 0
            seq = self.engine.fork(entry.seq) if entry is not None else self.engine.new_sequence()
        except BaseException as e:  # delivered to the request, which decides the status
            job._put(Failed(e), force=True)
            if steps is not None:
                steps.close()
            job._put(_END, force=True)
            return
        self.cache.record(reused)
        r = _Running(job, steps, ids, seq, reused, self.cache.cuts(ids, reused, self.boundary_id), self.steps,
                     self.cache.last_message(ids, reused, self.boundary_id))
        self._running.append(r)
        if entry is not None and reused == len(ids):  # the identical prompt again: its end-of-prompt logits
            self._answer(r, (entry.logits.copy(), reused))

    def _step(self) -> None:
        self.steps += 1
        for r, n in prefill_plan([r for r in self._running if r.done < len(r.ids)], self.max_batch_tokens):
            self._prefill(r, r.done + n)
        batch = [r for r in self._running if r.token is not None]
        for r in [r for r in batch if r.length >= self.max_seq]:  # no room for its token: the generation ends
            batch.remove(r)
            self._answer(r, error=ContextFullError(f"the context of {self.max_seq} tokens is full"))
        if not batch:
            return
        try:  # one sequence alone takes the single-sequence path (a backend's fastest, e.g. CUDA's graphs)
            rows = ([self.engine.decode(batch[0].token, seq=batch[0].seq)] if len(batch) == 1 else
                    self.engine.decode_batch([(r.seq, r.token) for r in batch]))
        except Exception as e:
            for r in batch:
                self._answer(r, error=e)
            return
        for r, row in zip(batch, rows):
            r.length += 1
            r.fed.append(r.token)
            self._answer(r, row)

    def _prefill(self, r: _Running, stop: int) -> None:
        """Advance ``r``'s prefill to ``stop`` tokens of its prompt, in pieces ending at its cuts (a copy kept in
        the prefix cache at each) and at the prompt's end (a copy with the logits; the generation is answered)."""
        while r.done < stop:
            end = min([stop, *(c for c in r.cuts if c > r.done)])
            try:
                logits = self.engine.prefill(r.ids[r.done:end], seq=r.seq)
                r.done = r.length = end
                if end in r.cuts:
                    self.cache.keep_cut(r.ids[:end], r.seq, r.last)
                if end == len(r.ids):
                    self.cache.add(list(r.ids), r.seq, logits.copy())
            except Exception as e:  # this request fails; the others go on
                self._answer(r, error=e)
                return
            if end == len(r.ids):
                self._answer(r, (logits, r.reused))

    def _answer(self, r: _Running, reply: Any = None, error: BaseException | None = None) -> None:
        """Send ``r``'s generation the engine's answer (or error) and run it to its next request, passing its
        chunks to the request; a finished, failed or cancelled generation leaves the batch."""
        r.token = None
        job = r.job
        try:
            item = r.steps.throw(error) if error is not None else r.steps.send(reply)
            while isinstance(item, Chunk):
                job.steps += 1
                if job.cancelled:
                    break
                if not job._put(item):
                    job.cancel("the client is not reading its stream")
                    break
                item = next(r.steps)
            else:
                assert isinstance(item, Decode), "a generation asks for its prompt once"
                r.token = item.token
                return
        except StopIteration:  # finished: its conversation's next turn may resume after this reply
            self._finish(r, keep=not job.cancelled)
            return
        except BaseException as e:  # delivered to the request, which decides the status
            job._put(Failed(e), force=True)
        self._finish(r)

    def _finish(self, r: _Running, keep: bool = False) -> None:
        """``r`` leaves the batch: its generation is closed, its sequence dropped (``keep``: first copied into
        the prefix cache, keyed by its prompt and the reply tokens it decoded, so that a next turn re-sending
        this reply resumes after it), its request told."""
        if r not in self._running:  # already gone (a step that failed half way through finishing it)
            return
        self._running.remove(r)
        with self._wake:
            self._departures.append(time.monotonic())
        tokens = r.ids + r.fed
        if keep and r.fed and r.length == len(tokens) and not self.cache.holds(tokens):
            try:
                self.cache.add(tokens, r.seq, persist=True)
            except Exception as e:  # the answer stands: a copy the cache could not make costs only the reuse
                warnings.warn(f"prefix cache: a finished reply was not kept ({e}); its next turn re-prefills it",
                              RuntimeWarning, stacklevel=1)
        try:
            r.steps.close()
        except Exception as e:  # the generation's cleanup failed: report it rather than lose it
            r.job._put(Failed(e), force=True)
        try:
            self.engine.drop_sequence(r.seq)
        except Exception as e:
            r.job._put(Failed(e), force=True)
        r.job._put(_END, force=True)
