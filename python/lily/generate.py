"""The generation loop: prompt ids in, ``Chunk``s out; and its chat view, ``ChatChunk``s with the thinking
split off and tool calls parsed.

Per token: sample from the logits (native), stop on an eos id, detokenize (streaming, whole UTF-8
characters only), check the stop strings, then ask for the next logits. The loop (``generation``) does not
call the engine itself: it yields ``Prefill`` / ``Decode`` requests, answered one generation at a time by
``run_steps`` (``Model.stream``) or for a batch of generations by the server's scheduler.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from lily._lily import Constraint, ContextFullError
from lily.outputs import AssistantMessage, ChatChunk, Chunk, GenerationStats
from lily.reasoning import ThinkSplitter, split_reasoning
from lily.sampling import Sampler
from lily.stop import StopStrings
from lily.tokenizer import Tokenizer
from lily.tools import parse_tool_calls

__all__ = ["Decode", "Prefill", "Steps", "chat_chunks", "echo", "generation", "run_steps"]


@dataclass(frozen=True)
class Prefill:
    """A generation's request to the engine: the logits after the prompt ``ids`` and how many of its leading
    tokens were reused (sent back as ``(logits, reused)``)."""

    ids: list[int]


@dataclass(frozen=True)
class Decode:
    """A generation's request to the engine: the logits after appending ``token`` (sent back; a
    ``ContextFullError`` thrown in ends the generation with ``finish_reason="length"``)."""

    token: int


Steps = Generator["Chunk | Prefill | Decode", Any, None]


def run_steps(steps: Steps, prefill: Callable[[list[int]], tuple[Any, int]],
              decode: Callable[[int], Any]) -> Iterator[Chunk]:
    """The ``Chunk``s of ``steps``, answering its engine requests with ``prefill`` and ``decode`` one at a time
    (a batching scheduler answers the requests of many generations together instead)."""
    reply: Any = None
    error: BaseException | None = None
    try:
        while True:
            try:
                item = steps.throw(error) if error is not None else steps.send(reply)
            except StopIteration:
                return
            reply = error = None
            if isinstance(item, Chunk):
                yield item
                continue
            try:
                reply = prefill(item.ids) if isinstance(item, Prefill) else decode(item.token)
            except Exception as e:  # the generation decides: a full context ends it, anything else goes on up
                error = e
    finally:
        steps.close()


def generation(tokenizer: Tokenizer, ids: list[int], sampler: Sampler, max_tokens: int, stops: list[str],
               logprobs: bool, top_logprobs: int = 0, constraint: Constraint | None = None) -> Steps:
    """The one generation loop, apart from the engine: yields ``Chunk``s for the caller and ``Prefill`` /
    ``Decode`` requests whose answers are sent back (``run_steps`` answers them for one sequence, the
    server's scheduler for a batch of them)."""
    stats = GenerationStats(prompt_tokens=len(ids))
    detok = tokenizer.detokenizer()
    t0 = time.perf_counter()
    logits, stats.cached_prompt_tokens = yield Prefill(ids)
    stats.prefill_s = time.perf_counter() - t0
    sampler.reset(ids)
    stop_strings = StopStrings(stops)
    eos = tokenizer.eos_ids
    t_first = None
    finish, hit = "length", False
    token: int | None = None
    lp: float | None = None
    top: list[tuple[int, float]] | None = None
    text = ""
    while stats.generated_tokens < max_tokens:
        token, lp = sampler.sample(logits, logprob=logprobs or top_logprobs > 0, constraint=constraint)
        if top_logprobs:
            top = sampler.top_logprobs(logits, top_logprobs)
        stats.generated_tokens += 1
        if t_first is None:
            t_first = time.perf_counter()
            stats.time_to_first_token_s = t_first - t0
        if token in eos:
            finish = "stop"
            break
        text, hit = stop_strings.feed(detok.add(token))
        if hit or stats.generated_tokens >= max_tokens:
            break  # the final chunk carries this token
        yield Chunk(text, token, lp, top_logprobs=top)
        text = ""
        try:
            logits = yield Decode(token)
        except ContextFullError:
            token = lp = top = None
            break
    if hit:
        finish = "stop"
    else:
        tail, hit = stop_strings.feed(detok.flush())
        text += tail
        if hit:
            finish = "stop"
        else:
            text += stop_strings.flush()
    stats.decode_s = time.perf_counter() - t_first if t_first is not None else 0.0
    yield Chunk(text, token, lp, finish, stats, top)


def chat_chunks(chunks: Iterator[Chunk], thinking: bool,
                tools: Sequence[Mapping[str, Any]] | None) -> Iterator[ChatChunk]:
    """``chunks`` as reasoning / content deltas; the last one holds the parsed ``AssistantMessage``."""
    splitter = ThinkSplitter(thinking)
    parts: list[str] = []
    for chunk in chunks:
        parts.append(chunk.text)
        reasoning, content = splitter.feed(chunk.text)
        if chunk.finish_reason is None:
            yield ChatChunk(reasoning, content, chunk.token, chunk.logprob)
            continue
        r_tail, c_tail = splitter.flush()
        reasoning_text, content_text = split_reasoning("".join(parts), thinking=thinking)
        content_text, calls = parse_tool_calls(content_text, tools)
        message = AssistantMessage(content_text, reasoning_text, calls, chunk.finish_reason, chunk.stats)
        yield ChatChunk(reasoning + r_tail, content + c_tail, chunk.token, chunk.logprob, chunk.finish_reason, message)


def echo(chunks: Iterator[Chunk], out: TextIO) -> Iterator[Chunk]:
    """``chunks`` passed through, their text printed to ``out`` as it streams and the timing after it, the way
    ``mlx_lm.generate(..., verbose=True)`` prints them (in a terminal and in a notebook cell alike)."""
    print("=" * 10, file=out, flush=True)
    for chunk in chunks:
        out.write(chunk.text)
        out.flush()
        if chunk.stats is not None:
            s = chunk.stats
            print("\n" + "=" * 10, file=out)
            print(f"Prompt: {s.prompt_tokens} tokens, {s.prompt_tps:.3f} tokens-per-sec", file=out)
            print(f"Generation: {s.generated_tokens} tokens, {s.decode_tps:.3f} tokens-per-sec", file=out, flush=True)
        yield chunk
