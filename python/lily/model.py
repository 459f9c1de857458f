"""``Model``: an engine plus everything around it (tokenizer, chat template, generation defaults), with
``generate`` / ``stream`` for text prompts and ``chat`` for conversations."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from lily._lily import Constraint, Engine, ModelLoadError, Vocab
from lily.arguments import flag, integer, mapping, strings, text, token_ids
from lily.generate import chat_chunks, echo, generation, run_steps
from lily.outputs import AssistantMessage, ChatChunk, Chunk, Completion, GenerationStats
from lily.prefix import SNAPSHOT_EVERY, CacheInfo, DiskTier, PrefixCache, PrefixReuse, model_fingerprint
from lily.sampling import Sampler, SamplingDefaults
from lily.structured import Grammar, GrammarLike, as_grammar
from lily.template import ChatTemplate
from lily.tokenizer import Tokenizer
from lily.tools import tool_call_arguments_as_mappings

__all__ = ["DEFAULT_MAX_TOKENS", "TEMPLATE_ARGUMENTS", "Model"]

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


#: ``apply_chat_template``'s own arguments: not template variables (``tokenize`` would make it return token ids)
TEMPLATE_ARGUMENTS = frozenset(["messages", "tools", "add_generation_prompt", "tokenize"])


def _keywords(name: str, value: Any) -> dict[str, Any]:
    out = dict(mapping(name, value if value is not None else {}))
    for k in out:
        if not isinstance(k, str):
            raise TypeError(f"{name} keys must be str, got {type(k).__name__} {k!r}")
        if k in TEMPLATE_ARGUMENTS:
            raise TypeError(f"{name} cannot set {k!r}: it is an argument of apply_chat_template, not a template "
                            "variable")
    return out


def _text_parts(messages: Sequence[Mapping[str, Any]]) -> None:
    """Refuse content parts the model cannot read. The chat template renders an image or video part as a
    placeholder token (the model, text only, would answer about a picture it never sees) and a part that is not a
    dict by substring tests (``["some text"]`` renders as nothing)."""
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, (list, tuple)):
            continue
        for j, part in enumerate(content):
            where = f"messages[{i}]['content'][{j}]"
            if not isinstance(part, Mapping):
                raise TypeError(f"{where} must be a dict such as {{'type': 'text', 'text': ...}}, got "
                                f"{type(part).__name__}")
            media = next((k for k in ("image", "image_url", "video") if k in part or part.get("type") == k), None)
            if media is not None:
                raise ValueError(f"{where}: {media} parts are not supported: the model reads text only")


class Model:
    """An engine plus everything around it: tokenizer, chat template and generation defaults.

    Made by ``lily.load``. One sequence at a time; a new prompt that shares a prefix with any earlier
    one (the next turn of a chat, a regenerated reply, another task with the same system prompt) only
    prefills what is new: copies of the sequence at known prefixes are kept in a byte-bounded cache
    (``prefix_cache_bytes``, default a quarter of the free memory; ``cache_info()`` reports it;
    ``lily.prefix``).

    Starting a generation takes the sequence from the one before: a stream resumed after another generation
    started on the same model raises ``SequenceEvictedError``. Threads may share a model: ``generate`` and
    ``chat`` (not streaming) run one at a time, and the steps of streams take turns with them.
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate | None = None,
        generation_config: Mapping[str, Any] | None = None,
        path: Path | None = None,
        prefix_cache_bytes: int | None = None,
        prefix_cache_dir: str | os.PathLike[str] | None = None,
        prefix_cache_dir_bytes: int | None = None,
        prefix_cache_snapshot_every: int | None = None,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.generation_config = dict(generation_config or {})
        self.defaults = SamplingDefaults.from_generation_config(self.generation_config)
        self.path = path
        disk = None
        if prefix_cache_dir is not None:
            if path is None:
                raise ValueError("prefix_cache_dir needs the checkpoint's path (to tell its files from other models')")
            disk = DiskTier(prefix_cache_dir, model_fingerprint(path, engine.config), engine.kv_dtype,
                            prefix_cache_dir_bytes)
        every = SNAPSHOT_EVERY if prefix_cache_snapshot_every is None else prefix_cache_snapshot_every
        cache = PrefixCache(engine, prefix_cache_bytes, snapshot_every=every, disk=disk)
        self.prefix = PrefixReuse(engine, tokenizer.token_to_id("<|im_start|>"), cache)
        self._vocab: Vocab | None = None

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
        rendered = self.chat_template.render(
            messages, tools=tools, add_generation_prompt=flag("add_generation_prompt", add_generation_prompt),
            **template_kwargs
        )
        return self.tokenizer.encode(rendered) if flag("tokenize", tokenize) else rendered

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

    def constrain(self, grammar: Grammar) -> Constraint:
        """A fresh ``Constraint`` enforcing ``grammar`` over one generation (``ValueError`` if it does not
        compile). The token table behind it is built on first use (~0.3 s for the Qwen3.6 vocabulary)."""
        if self._vocab is None:
            tok = self.tokenizer
            table = [tok.token_bytes(i) for i in range(len(tok))]
            eos = sorted(tok.eos_ids)
            if not eos:
                raise ValueError("structured output needs an end-of-sequence id; the checkpoint names none")
            self._vocab = Vocab(table, special=sorted(tok.special_ids), eos=eos,
                                rows=max(self.engine.vocab_size, len(table)))
        return self._vocab.constrain(grammar.kind, grammar.source)

    def reset(self) -> None:
        """Empty the engine's sequence and forget the saved prefixes in memory (disk tier files stay)."""
        self.prefix.reset()

    def cache_info(self) -> CacheInfo:
        """The prefix cache: entries, bytes (and the bound), hits, misses, prompt tokens saved, evictions, and the
        disk tier's files, bytes (and bound), hits read from it and writes dropped, skipped or failed."""
        with self.prefix.turn:
            return self.prefix.cache.info()

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(text("prompt", prompt))
        elif isinstance(prompt, (bytes, bytearray, Mapping)) or not isinstance(prompt, Iterable):
            raise TypeError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        else:
            ids = token_ids("prompt", prompt, self.engine.vocab_size)
        if not ids:
            raise ValueError("empty prompt")
        return ids

    # ---- generation

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int | None = None,
        stop: str | Sequence[str] | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
        json_schema: Mapping[str, Any] | str | bool | None = None,
        grammar: GrammarLike | None = None,
        sampler: Sampler | None = None,
        **sampling: Any,
    ) -> Iterator[Chunk]:
        """Generate from ``prompt`` (text, used as is, or token ids), one ``Chunk`` per token.

        Stops on the checkpoint's eos ids (``finish_reason="stop"``), on any of ``stop`` (the text
        ends before it), or after ``max_tokens`` or when the context is full (``"length"``).
        Sampling options (``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``,
        ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``seed``) default to the
        checkpoint's ``generation_config.json``; or pass a ready ``sampler``. ``top_logprobs=k`` adds
        the k most likely ids to each chunk. Structured output: ``json_schema`` (a JSON schema) or
        ``grammar`` (a ``lily.Grammar``, a Lark grammar as a str, or a compiled regex) is enforced
        token by token; generation ends when it is complete.
        """
        if sampler is None:
            sampler = self.sampler(**sampling)
        elif sampling:
            raise TypeError("pass either sampler= or sampling options, not both")
        elif not isinstance(sampler, Sampler):
            raise TypeError(f"sampler must be a lily.Sampler, got {type(sampler).__name__}")
        max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else integer("max_tokens", max_tokens, low=0)
        top_logprobs = integer("top_logprobs", top_logprobs, low=0, high=1000)
        stops = strings("stop", stop)
        ids = self._prompt_ids(prompt)
        rule = as_grammar(json_schema, grammar)
        constraint = None if rule is None else self.constrain(rule)
        steps = generation(self.tokenizer, ids, sampler, max_tokens, stops, flag("logprobs", logprobs), top_logprobs,
                           constraint)
        ticket = object()
        return run_steps(steps, lambda ids: self.prefix.prefill(ids, ticket),
                         lambda token: self.prefix.decode(ticket, token))

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int | None = None,
        stop: str | Sequence[str] | None = None,
        logprobs: bool = False,
        json_schema: Mapping[str, Any] | str | bool | None = None,
        grammar: GrammarLike | None = None,
        sampler: Sampler | None = None,
        verbose: bool = False,
        **sampling: Any,
    ) -> Completion:
        """``stream`` collected: the generated text (a ``str``) with ``.tokens``, ``.logprobs``,
        ``.finish_reason`` and ``.stats``. ``json_schema`` / ``grammar`` enforce structured output (see
        ``stream``): ``json.loads(model.generate(p, json_schema=s))`` follows ``s``. ``verbose=True``
        prints the text as it streams, then the speeds, as ``mlx_lm.generate(..., verbose=True)`` does."""
        parts: list[str] = []
        tokens: list[int] = []
        lps: list[float] = []
        finish, stats = None, GenerationStats()
        chunks = self.stream(prompt, max_tokens=max_tokens, stop=stop, logprobs=logprobs, json_schema=json_schema,
                             grammar=grammar, sampler=sampler, **sampling)
        with self.prefix.turn:  # the whole generation, so that another thread's waits for it
            for chunk in echo(chunks, sys.stdout) if flag("verbose", verbose) else chunks:
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
        json_schema: Mapping[str, Any] | str | bool | None = None,
        grammar: GrammarLike | None = None,
        sampler: Sampler | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        verbose: bool = False,
        **sampling: Any,
    ) -> AssistantMessage | Iterator[ChatChunk]:
        """Answer a conversation (OpenAI-style message dicts) with an ``AssistantMessage``: ``content``,
        ``reasoning_content`` (the thinking, separated) and ``tool_calls`` (OpenAI format, parsed
        from Qwen's XML calls; malformed calls stay in ``content``). With ``stream=True``, an
        iterator of ``ChatChunk``s whose last one holds the message. Assistant messages from earlier
        turns (including ``tool_calls`` with JSON-string arguments) can be passed back as they are.
        ``verbose=True`` prints the generated text as it streams, then the speeds (as ``generate``).
        ``json_schema`` / ``grammar`` constrain the answer (the thinking before it stays free).
        """
        if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Iterable):
            raise TypeError(f"messages must be a list of message dicts, got {type(messages).__name__}")
        messages = list(messages)
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise TypeError(f"messages[{i}] must be a dict (role, content, ...), got {type(m).__name__}")
        _text_parts(messages)
        prompt = self.apply_chat_template(
            tool_call_arguments_as_mappings(messages),
            tools=tools,
            add_generation_prompt=True,
            enable_thinking=flag("enable_thinking", enable_thinking),
            **_keywords("template_kwargs", template_kwargs),
        )
        assert isinstance(prompt, str)
        thinking = prompt.rstrip().endswith("<think>")
        rule = as_grammar(json_schema, grammar)
        if rule is not None and thinking:
            rule = rule.after_thinking()
        chunks = self.stream(prompt, max_tokens=max_tokens, stop=stop, logprobs=logprobs, grammar=rule,
                             sampler=sampler, **sampling)
        gen = chat_chunks(echo(chunks, sys.stdout) if flag("verbose", verbose) else chunks, thinking, tools)
        if flag("stream", stream):
            return gen
        with self.prefix.turn:
            for chunk in gen:
                if chunk.message is not None:
                    return chunk.message
        raise RuntimeError("generation ended without a final chunk")  # pragma: no cover
