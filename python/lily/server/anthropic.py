"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``), streaming and not: the
API Claude Code speaks (``ANTHROPIC_BASE_URL=http://127.0.0.1:PORT``)."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pydantic
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from lily.server import schemas
from lily.server.app import EventStream, Limits, WatchedJson, parse_body, validation_error
from lily.server.errors import ApiError
from lily.server.generation import Plan, Service, Turn, collect, engine_error
from lily.server.worker import HEARTBEAT, Job
from lily.structured import Grammar

__all__ = ["Anthropic"]

_TOOL_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,128}\Z")
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _validate(cls: type[pydantic.BaseModel], body: dict[str, Any]) -> Any:
    try:
        return cls.model_validate(body)
    except pydantic.ValidationError as e:
        raise validation_error(e) from None


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n".encode()


def _text(blocks: Any, param: str, *, placeholders: bool = False) -> str:
    """The text of ``blocks``. Other blocks (images, documents) are refused, or with ``placeholders`` (in tool
    results, where an agent's tool returned them) replaced by a note the model can read."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    parts = []
    for b in blocks:
        if isinstance(b, schemas.AText):
            parts.append(b.text)
        elif placeholders:
            parts.append(f"[{b.type} omitted: this model reads text only]")
        else:
            raise ApiError(f"{param}: content blocks of type {b.type!r} are not supported here (text only)",
                           param=param)
    return "\n".join(parts)


def chat_messages(system: Any, messages: list[schemas.AMessage]) -> list[dict[str, Any]]:
    """Anthropic's system + messages as the chat template's messages: ``tool_use`` blocks become
    ``tool_calls``, ``tool_result`` blocks ``tool`` messages, ``thinking`` blocks the reasoning."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, reasoning, calls = [], [], []
        for j, block in enumerate(m.content):
            param = f"messages.{i}.content.{j}"
            if isinstance(block, schemas.AText):
                texts.append(block.text)
            elif isinstance(block, schemas.AThinking) and m.role == "assistant":
                reasoning.append(block.thinking)
            elif isinstance(block, schemas.ARedactedThinking):
                continue
            elif isinstance(block, schemas.AToolUse) and m.role == "assistant":
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": block.input}})
            elif isinstance(block, schemas.AToolResult) and m.role == "user":
                content = _text(block.content, f"{param}.content", placeholders=True)
                if block.is_error:
                    content = f"Error: {content}"
                out.append({"role": "tool", "content": content, "tool_call_id": block.tool_use_id})
            else:
                raise ApiError(f"{param}: content blocks of type {block.type!r} are not supported in "
                               f"{m.role} messages", param=param)
        if texts or reasoning or calls or m.role == "assistant":
            msg: dict[str, Any] = {"role": m.role, "content": "\n\n".join(texts)}
            if reasoning:
                msg["reasoning_content"] = "\n".join(reasoning)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _tools(tools: list[schemas.ATool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out: list[dict[str, Any]] = []
    for i, t in enumerate(tools):
        if t.type not in (None, "custom"):
            continue  # a server tool (web search, code execution, ...): there is no server side to run it here
        if not _TOOL_NAME.match(t.name):
            raise ApiError(f"tools.{i}.name: {t.name!r} must be 1-128 letters, digits, '_' or '-'",
                           param=f"tools.{i}.name")
        fn: dict[str, Any] = {"name": t.name, "parameters": t.input_schema or {"type": "object"}}
        if t.description:
            fn["description"] = t.description
        if t.strict:
            fn["strict"] = True
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(choice: schemas.AToolChoice | None, tools: list[dict[str, Any]] | None) -> tuple[str, bool]:
    """(tool_choice in OpenAI terms, parallel calls allowed)"""
    if choice is None:
        return "auto", True
    parallel = not choice.disable_parallel_tool_use
    if choice.type in ("any", "tool") and not tools:
        raise ApiError(f"tool_choice {choice.type!r} needs tools", param="tool_choice")
    if choice.type == "tool":
        if not choice.name:
            raise ApiError("tool_choice of type 'tool' needs a name", param="tool_choice.name")
        return choice.name, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def _thinking(config: schemas.AThinkingConfig | None) -> bool | None:
    if config is None:
        return None  # the model's default (the chat template turns thinking on)
    return config.type != "disabled"


class Anthropic:
    """The Anthropic endpoints over one ``Service``."""

    def __init__(self, service: Service, limits: Limits):
        self.service, self.limits = service, limits

    def routes(self) -> list[Route]:
        return [
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
        ]

    async def count_tokens(self, request: Request) -> Any:
        req = _validate(schemas.CountTokensRequest, parse_body(await request.body()))
        self.service.check_model(req.model)
        messages, tools = chat_messages(req.system, req.messages), _tools(req.tools)
        service = self.service

        def count() -> int:
            kwargs = {} if _thinking(req.thinking) is None else {"enable_thinking": _thinking(req.thinking)}
            return len(service.tokenize(service.render(messages, tools, kwargs)))

        return JSONResponse({"input_tokens": await asyncio.to_thread(count)})

    async def messages(self, request: Request) -> Any:
        req = _validate(schemas.MessagesRequest, parse_body(await request.body()))
        self.service.check_model(req.model)
        if not req.messages:
            raise ApiError("messages: at least one message is required", param="messages")
        tools = _tools(req.tools)
        tool_choice, parallel = _tool_choice(req.tool_choice, tools)
        sampling = {k: v for k, v in (("temperature", req.temperature), ("top_p", req.top_p), ("top_k", req.top_k))
                    if v is not None}
        fmt = req.output_config.format if req.output_config else None
        text = None
        if fmt is not None:
            try:
                text = Grammar.json_schema(fmt.schema_)
            except (TypeError, ValueError) as e:
                raise ApiError(str(e), param="output_config.format.schema") from None
        plan: Plan = await self.service.prepare(
            self.service.prepare_chat, chat_messages(req.system, req.messages), tools=tools, tool_choice=tool_choice,
            parallel_tool_calls=parallel, thinking=_thinking(req.thinking), max_tokens=req.max_tokens,
            stop=req.stop_sequences or [], sampling=sampling, text=text)
        job = self.service.start(plan)
        turn = Turn(plan, self.service)
        mid = f"msg_{uuid.uuid4().hex[:24]}"
        if req.stream:
            return EventStream(job, self._events(job, turn, mid, req.model))

        async def build() -> tuple[int, dict[str, Any]]:
            await collect(job, turn)
            return 200, self._message(turn, mid, req.model, self._blocks(turn))

        return WatchedJson(job, build)

    def _usage(self, turn: Turn, output_tokens: int) -> dict[str, Any]:
        # Anthropic counts cache reads apart: input_tokens + cache_read_input_tokens is the whole prompt.
        return {"input_tokens": turn.prompt_tokens - turn.cached_tokens, "output_tokens": output_tokens,
                "cache_read_input_tokens": turn.cached_tokens, "cache_creation_input_tokens": 0}

    def _message(self, turn: Turn, mid: str, model: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        done = turn.done
        return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
                "stop_reason": self._stop_reason(turn) if done else None,
                "stop_sequence": turn.stop_sequence if done else None,
                "usage": self._usage(turn, turn.completion_tokens if done else 0)}

    @staticmethod
    def _stop_reason(turn: Turn) -> str:
        if turn.stop_sequence is not None:
            return "stop_sequence"
        return _STOP_REASONS.get(turn.finish_reason or "stop", "end_turn")

    @staticmethod
    def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
        fn = call["function"]
        return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": fn["name"],
                "input": json.loads(fn["arguments"])}

    def _blocks(self, turn: Turn) -> list[dict[str, Any]]:
        blocks: list[dict[str, Any]] = []
        if turn.parser.reasoning_content:
            blocks.append({"type": "thinking", "thinking": turn.parser.reasoning_content, "signature": ""})
        if turn.parser.content:
            blocks.append({"type": "text", "text": turn.parser.content})
        blocks += [self._tool_use(c) for c in turn.tool_calls]
        return blocks

    async def _events(self, job: Job, turn: Turn, mid: str, model: str) -> AsyncIterator[bytes]:
        yield _event("message_start", {"message": self._message(turn, mid, model, [])})
        yield _event("ping", {})
        index, open_kind = -1, None

        def close() -> list[bytes]:
            nonlocal open_kind
            if open_kind is None:
                return []
            out = []
            if open_kind == "thinking":
                out.append(_event("content_block_delta", {"index": index,
                                                          "delta": {"type": "signature_delta", "signature": ""}}))
            out.append(_event("content_block_stop", {"index": index}))
            open_kind = None
            return out

        def start(kind: str, block: dict[str, Any]) -> list[bytes]:
            nonlocal index, open_kind
            out = close()
            index += 1
            open_kind = kind
            out.append(_event("content_block_start", {"index": index, "content_block": block}))
            return out

        try:
            async for event in job.events(heartbeat=self.limits.ping_interval):
                if event is HEARTBEAT:
                    yield _event("ping", {})
                    continue
                for d in turn.add(event):
                    kind = "thinking" if d.kind == "reasoning" else "text"
                    if open_kind != kind:
                        empty = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {
                            "type": "text", "text": ""}
                        for b in start(kind, empty):
                            yield b
                    delta = {"type": "thinking_delta", "thinking": d.text} if kind == "thinking" else {
                        "type": "text_delta", "text": d.text}
                    yield _event("content_block_delta", {"index": index, "delta": delta})
                if turn.done:
                    for b in close():
                        yield b
                    for call in turn.tool_calls:
                        block = self._tool_use(call)
                        for b in start("tool_use", {**block, "input": {}}):
                            yield b
                        arguments = json.dumps(block["input"], ensure_ascii=False)
                        yield _event("content_block_delta", {"index": index, "delta": {
                            "type": "input_json_delta", "partial_json": arguments}})
                    for b in close():
                        yield b
                    yield _event("message_delta", {
                        "delta": {"stop_reason": self._stop_reason(turn), "stop_sequence": turn.stop_sequence},
                        "usage": self._usage(turn, turn.completion_tokens)})
                    yield _event("message_stop", {})
        except Exception as e:
            yield _event("error", {"error": engine_error(e).anthropic()["error"]})
