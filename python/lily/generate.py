"""``lily.load`` and ``Model``: prompt in, tokens and text out, streaming, chat with thinking and tools.

The loop per token is: sample from the logits (native), stop on an eos id, detokenize (streaming,
whole UTF-8 characters only), check the stop strings, then ``engine.decode(token)``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from lily._lily import ContextFullError, Engine, ModelLoadError
from lily.hub import resolve_model, warm_page_cache
from lily.sampling import Sampler, SamplingDefaults
from lily.template import ChatTemplate
from lily.tokenizer import Tokenizer
from lily.tools import parse_tool_calls, split_reasoning

__all__ = [
    "AssistantMessage",
    "ChatChunk",
    "Chunk",
    "Completion",
    "GenerationStats",
    "Model",
    "load",
]

#: default ``max_tokens`` when none is given
DEFAULT_MAX_TOKENS = 4096

_SAMPLING_KEYS = frozenset(
    [
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "seed",
    ]
)


@dataclasses.dataclass
class GenerationStats:
    """Timing of one generation. Prefill covers the prompt tokens not already in the engine."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    time_to_first_token_s: float = 0.0

    @property
    def prompt_tps(self) -> float:
        computed = self.prompt_tokens - self.cached_prompt_tokens
        return computed / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        # the first token comes from the prefill logits; each later one costs one decode
        steps = self.generated_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    def __str__(self) -> str:
        return (
            f"prompt {self.prompt_tokens} tok @ {self.prompt_tps:.1f} tok/s | "
            f"decode {self.generated_tokens} tok @ {self.decode_tps:.1f} tok/s | "
            f"ttft {self.time_to_first_token_s:.3f} s"
        )


@dataclasses.dataclass
class Chunk:
    """One step of ``Model.stream``: the text it adds (may be empty while a character is incomplete),
    the sampled token, its logprob when asked for, and ``finish_reason`` ("stop" or "length") on the
    last chunk, which also carries ``stats``."""

    text: str
    token: int | None
    logprob: float | None = None
    finish_reason: str | None = None
    stats: GenerationStats | None = None


class Completion(str):
    """The text ``Model.generate`` returns, with ``tokens``, ``logprobs``, ``finish_reason`` and ``stats``."""

    tokens: list[int]
    logprobs: list[float] | None
    finish_reason: str | None
    stats: GenerationStats

    def __new__(cls, text: str, tokens, logprobs, finish_reason, stats):
        self = super().__new__(cls, text)
        self.tokens = tokens
        self.logprobs = logprobs
        self.finish_reason = finish_reason
        self.stats = stats
        return self

    @property
    def text(self) -> str:
        return str.__str__(self)


class AssistantMessage(dict):
    """An assistant message as a dict (``role``, ``content``, ``reasoning_content``, ``tool_calls``),
    ready to append to the conversation; also ``.content`` etc., ``.finish_reason`` and ``.stats``."""

    def __init__(self, content: str, reasoning_content: str | None, tool_calls: list, finish_reason, stats):
        super().__init__(role="assistant", content=content, reasoning_content=reasoning_content, tool_calls=tool_calls)
        self.finish_reason = finish_reason
        self.stats = stats

    @property
    def content(self) -> str:
        return self["content"]

    @property
    def reasoning_content(self) -> str | None:
        return self["reasoning_content"]

    @property
    def tool_calls(self) -> list:
        return self["tool_calls"]


@dataclasses.dataclass
class ChatChunk:
    """One step of ``Model.chat(..., stream=True)``: new thinking text and/or new answer text. The last
    chunk has ``finish_reason`` and ``message``, the complete parsed ``AssistantMessage``."""

    reasoning: str
    content: str
    token: int | None
    logprob: float | None = None
    finish_reason: str | None = None
    message: AssistantMessage | None = None


class _StopStrings:
    """Finds user stop strings in streamed text, holding back a tail that may be the start of one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.rest = ""  # the text after the stop string that was hit

    def feed(self, delta: str) -> tuple[str, bool]:
        """Text safe to emit, and whether a stop string was hit (the text ends before it)."""
        if not self.stops:
            return delta, False
        buf = self.pending + delta
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            at = min(hits)
            stop = next(s for s in self.stops if buf.find(s) == at)
            self.pending = ""
            self.rest = buf[at + len(stop) :]
            return buf[:at], True
        keep = 0
        for k in range(min(self.hold, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                keep = k
                break
        self.pending = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class _ThinkSplitter:
    """Routes streamed text to the reasoning or the content side of ``</think>``."""

    def __init__(self, thinking: bool):
        self.in_reasoning = thinking
        self.stop = _StopStrings(["</think>"])
        self.content_started = False

    def feed(self, delta: str) -> tuple[str, str]:
        if not self.in_reasoning:
            return "", self._content(delta)
        text, hit = self.stop.feed(delta)
        if not hit:
            return text, ""
        self.in_reasoning = False
        return text, self._content(self.stop.rest)

    def _content(self, text: str) -> str:
        if not self.content_started:
            text = text.lstrip()
            self.content_started = bool(text)
        return text

    def flush(self) -> tuple[str, str]:
        tail = self.stop.flush()
        return (tail, "") if self.in_reasoning else ("", self._content(tail))


class Model:
    """An engine plus everything around it: tokenizer, chat template and generation defaults.

    Made by ``lily.load``. One sequence at a time; a new prompt that shares a prefix with an earlier
    one (the next turn of a chat) only prefills what is new, thanks to engine snapshots.
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate | None = None,
        generation_config: Mapping[str, Any] | None = None,
        path: Path | None = None,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.generation_config = dict(generation_config or {})
        self.defaults = SamplingDefaults.from_generation_config(self.generation_config)
        self.path = path
        # Saved DeltaNet states for prefix reuse (each is ~63 MB for Qwen3.6-35B-A3B): newest last.
        self._snapshots: list[Any] = []
        self.max_snapshots = 4
        self._boundary_id = tokenizer.token_to_id("<|im_start|>")

    def __repr__(self) -> str:
        return f"Model(path={str(self.path)!r}, backend={getattr(self.engine, 'backend', '?')!r})"

    @property
    def config(self) -> dict:
        return self.engine.config

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.tokenizer.eos_ids

    # ---- prompts

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """The checkpoint's chat template applied to ``messages``, as ``transformers`` renders it
        (``enable_thinking``, ``preserve_thinking``, ... go in ``template_kwargs``). Returns the text,
        or its token ids with ``tokenize=True``."""
        if self.chat_template is None:
            raise ModelLoadError(f"{self.path}: the checkpoint has no chat template")
        text = self.chat_template.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        return self.tokenizer.encode(text) if tokenize else text

    def sampler(self, **settings: Any) -> Sampler:
        """A ``Sampler`` with the checkpoint's defaults, overridden by ``settings``; padding ids are masked."""
        unknown = set(settings) - _SAMPLING_KEYS
        if unknown:
            raise TypeError(f"unknown sampling option(s): {', '.join(sorted(unknown))}")
        d = self.defaults
        base: dict[str, Any] = {
            "temperature": d.temperature if d.do_sample else 0.0,
            "top_k": d.top_k,
            "top_p": d.top_p,
            "min_p": d.min_p,
            "repetition_penalty": d.repetition_penalty,
        }
        base.update({k: v for k, v in settings.items() if v is not None})
        return Sampler(**base, vocab_limit=len(self.tokenizer))

    # ---- the engine

    def reset(self) -> None:
        """Empty the engine's sequence and forget the saved prefixes."""
        self.engine.reset()
        self._snapshots.clear()

    def _prefill(self, tokens: list[int]) -> tuple[Any, int]:
        """Logits after ``tokens``, and how many leading tokens were reused rather than computed.

        Prefix reuse across turns: the DeltaNet state cannot be cut back like a KV cache, so the
        engine is returned to the latest snapshot that the new prompt extends (snapshots are taken
        at the start of the last message of each prompt, a point the next turn's prompt shares),
        or continues directly when the prompt extends the engine's current sequence.
        """
        eng = self.engine
        # Reuse at most len - 1 tokens: the last one must run to give the logits.
        cached = min(eng.cached_prefix(tokens), len(tokens) - 1)
        if 0 < eng.position <= cached:
            start = eng.position
        else:
            best = max((s for s in self._snapshots if s.position <= cached), key=lambda s: s.position, default=None)
            start = 0
            if best is not None:
                try:
                    eng.restore(best)
                    start = best.position
                except ValueError:  # its rows were overwritten since
                    self._snapshots.remove(best)
            if start == 0:
                eng.reset()
        # Snapshot at the last message boundary, so the next turn can come back to it.
        cut = next((i for i in range(len(tokens) - 1, start, -1) if tokens[i] == self._boundary_id), None)
        if cut is not None and self._boundary_id is not None:
            eng.prefill(tokens[start:cut])
            self._remember(eng.snapshot())
            logits = eng.prefill(tokens[cut:])
        else:
            logits = eng.prefill(tokens[start:])
        return logits, start

    def _remember(self, snap: Any) -> None:
        self._snapshots = [s for s in self._snapshots if s.position != snap.position]
        self._snapshots.append(snap)
        del self._snapshots[: -self.max_snapshots]

    def _decode(self, token: int):
        return self.engine.decode(token)

    # ---- generation

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt")
        return ids

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int | None = None,
        stop: str | Sequence[str] | None = None,
        logprobs: bool = False,
        sampler: Sampler | None = None,
        **sampling: Any,
    ) -> Iterator[Chunk]:
        """Generate from ``prompt`` (text, used as is, or token ids), one ``Chunk`` per token.

        Stops on the checkpoint's eos ids (``finish_reason="stop"``), on any of ``stop`` (the text
        ends before it), or after ``max_tokens`` or when the context is full (``"length"``).
        Sampling options (``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``,
        ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``seed``) default to the
        checkpoint's ``generation_config.json``; or pass a ready ``sampler``.
        """
        if sampler is None:
            sampler = self.sampler(**sampling)
        elif sampling:
            raise TypeError("pass either sampler= or sampling options, not both")
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        ids = self._prompt_ids(prompt)
        return self._stream(ids, sampler, max_tokens, stops, logprobs)

    def _stream(
        self, ids: list[int], sampler: Sampler, max_tokens: int, stops: list[str], logprobs: bool
    ) -> Iterator[Chunk]:
        stats = GenerationStats(prompt_tokens=len(ids))
        detok = self.tokenizer.detokenizer()
        t0 = time.perf_counter()
        logits, stats.cached_prompt_tokens = self._prefill(ids)
        stats.prefill_s = time.perf_counter() - t0
        sampler.reset(ids)
        stop_strings = _StopStrings(stops)
        eos = self.tokenizer.eos_ids
        t_first = None
        finish, hit = "length", False
        token: int | None = None
        lp: float | None = None
        text = ""
        while stats.generated_tokens < max_tokens:
            token, lp = sampler.sample(logits, logprob=logprobs)
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
            yield Chunk(text, token, lp)
            text = ""
            try:
                logits = self._decode(token)
            except ContextFullError:
                token = lp = None
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
        yield Chunk(text, token, lp, finish, stats)

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int | None = None,
        stop: str | Sequence[str] | None = None,
        logprobs: bool = False,
        sampler: Sampler | None = None,
        **sampling: Any,
    ) -> Completion:
        """``stream`` collected: the generated text (a ``str``) with ``.tokens``, ``.logprobs``,
        ``.finish_reason`` and ``.stats``."""
        parts: list[str] = []
        tokens: list[int] = []
        lps: list[float] = []
        finish, stats = None, GenerationStats()
        for chunk in self.stream(
            prompt, max_tokens=max_tokens, stop=stop, logprobs=logprobs, sampler=sampler, **sampling
        ):
            parts.append(chunk.text)
            if chunk.token is not None:
                tokens.append(chunk.token)
                if chunk.logprob is not None:
                    lps.append(chunk.logprob)
            if chunk.finish_reason is not None:
                finish, stats = chunk.finish_reason, chunk.stats or stats
        return Completion("".join(parts), tokens, lps if logprobs else None, finish, stats)

    # ---- chat

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None = None,
        enable_thinking: bool = True,
        stream: bool = False,
        *,
        max_tokens: int | None = None,
        stop: str | Sequence[str] | None = None,
        logprobs: bool = False,
        sampler: Sampler | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        **sampling: Any,
    ) -> AssistantMessage | Iterator[ChatChunk]:
        """Answer a conversation (OpenAI-style message dicts) with an ``AssistantMessage``: ``content``,
        ``reasoning_content`` (the thinking, separated) and ``tool_calls`` (OpenAI format, parsed
        from Qwen's XML calls; malformed calls stay in ``content``). With ``stream=True``, an
        iterator of ``ChatChunk``s whose last one holds the message. Assistant messages from earlier
        turns (including ``tool_calls`` with JSON-string arguments) can be passed back as they are.
        """
        prompt = self.apply_chat_template(
            _prepare_messages(messages),
            tools=tools,
            add_generation_prompt=True,
            enable_thinking=enable_thinking,
            **dict(template_kwargs or {}),
        )
        assert isinstance(prompt, str)
        thinking = prompt.rstrip().endswith("<think>")
        chunks = self.stream(
            prompt, max_tokens=max_tokens, stop=stop, logprobs=logprobs, sampler=sampler, **sampling
        )
        gen = self._chat_chunks(chunks, thinking, tools)
        if stream:
            return gen
        for chunk in gen:
            if chunk.message is not None:
                return chunk.message
        raise RuntimeError("generation ended without a final chunk")  # pragma: no cover

    def _chat_chunks(self, chunks: Iterator[Chunk], thinking: bool, tools) -> Iterator[ChatChunk]:
        splitter = _ThinkSplitter(thinking)
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
            yield ChatChunk(
                reasoning + r_tail, content + c_tail, chunk.token, chunk.logprob, chunk.finish_reason, message
            )


def _prepare_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-style tool calls carry ``arguments`` as a JSON string; the template wants a mapping."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for call in calls:
                if isinstance(call, Mapping):
                    call = dict(call)
                    fn = call.get("function")
                    if isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
                        fn = dict(fn)
                        try:
                            fn["arguments"] = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
                        except json.JSONDecodeError:
                            pass
                        call["function"] = fn
                fixed.append(call)
            m["tool_calls"] = fixed
        out.append(m)
    return out


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: {e}") from e
    return data if isinstance(data, dict) else {}


def _eos_ids(folder: Path, generation_config: dict, tokenizer: Tokenizer) -> set[int]:
    ids: set[int] = set()

    def add(value):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))

    add(generation_config.get("eos_token_id"))
    if not ids:
        config = _read_json(folder / "config.json")
        add(config.get("eos_token_id"))
        add((config.get("text_config") or {}).get("eos_token_id"))
    eos = _read_json(folder / "tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if isinstance(eos, str) and tokenizer.token_to_id(eos) is not None:
        ids.add(tokenizer.token_to_id(eos))
    return ids

BACKENDS = ("auto", "cpu", "metal", "cuda", "cpu-reference", "metal-sim")


def load(
    model: str | os.PathLike[str],
    *,
    backend: str = "auto",
    max_seq: int | None = None,
    prefill_chunk: int | None = None,
    revision: str | None = None,
    progress: bool = True,
) -> Model:
    """Load a checkpoint: a local folder or a Hugging Face repo id (downloaded into the standard cache).

    ``backend`` is "auto", "cpu", "metal" or "cuda" (or "cpu-reference", "metal-sim"); ``max_seq`` caps
    the context (default: the engine's); ``prefill_chunk`` the tokens per prefill step (default: the
    backend's; smaller saves memory). Raises ``ModelLoadError`` with what to do when the model cannot
    be found or read.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    folder = resolve_model(model, revision=revision, progress=progress)
    generation_config = _read_json(folder / "generation_config.json")
    try:
        tokenizer = Tokenizer.from_file(folder / "tokenizer.json")
    except FileNotFoundError as e:
        raise ModelLoadError(f"{folder}: no tokenizer.json in the checkpoint folder") from e
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise ModelLoadError(f"{folder / 'tokenizer.json'}: {e}") from e
    tokenizer = Tokenizer(tokenizer.backend, eos_ids=_eos_ids(folder, generation_config, tokenizer))
    tokenizer.detokenizer()  # builds the id -> bytes table now rather than during the first generation
    template = ChatTemplate.from_dir(folder)
    warm_page_cache(folder, progress=progress)
    engine = _open_engine(folder, backend, max_seq, prefill_chunk, progress)
    return Model(engine, tokenizer, template, generation_config, folder)


def _open_engine(folder: Path, backend: str, max_seq: int | None, prefill_chunk: int | None,
                 progress: bool) -> Engine:
    """The engine, with a per-layer progress bar on stderr for large (>= 1 GiB) checkpoints."""
    if not progress or sum(f.stat().st_size for f in folder.glob("*.safetensors")) < 1 << 30:
        return Engine(str(folder), backend=backend, max_seq=max_seq, prefill_chunk=prefill_chunk)
    bar = None

    def report(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            try:
                from tqdm.auto import tqdm
            except ImportError:  # pragma: no cover - tqdm comes with huggingface_hub
                return
            bar = tqdm(total=total, unit="layer", desc="Loading layers", file=sys.stderr, leave=False)
        bar.update(done - bar.n)

    try:
        return Engine(str(folder), backend=backend, max_seq=max_seq, prefill_chunk=prefill_chunk,
                      progress=report)
    finally:
        if bar is not None:
            bar.close()
