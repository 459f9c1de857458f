"""OpenAI's APIs: chat completions, completions and responses (``/v1/...``), streaming and not."""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import pydantic
from starlette.requests import Request
from starlette.routing import Route

from lily.model import TEMPLATE_ARGUMENTS
from lily.server import schemas
from lily.server.app import EventStream, Limits, WatchedJson, parse_body, validation_error
from lily.server.errors import ApiError
from lily.server.generation import Plan, Service, Turn, collect, engine_error, openai_tools
from lily.server.worker import HEARTBEAT, Job
from lily.structured import Grammar

__all__ = ["OpenAI"]

_THINKING_OFF_EFFORTS = ("none", "minimal")


def _validate(cls: type[pydantic.BaseModel], body: dict[str, Any]) -> Any:
    try:
        return cls.model_validate(body)
    except pydantic.ValidationError as e:
        raise validation_error(e) from None


def _sse(payload: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return (head + "data: " + json.dumps(payload, ensure_ascii=False) + "\n\n").encode()


def part_text(content: Any, param: str) -> str:
    """The text of a message's content (a string or text parts); other parts are refused."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if not isinstance(part, schemas.TextPart):
            raise ApiError(f"content parts of type {part.type!r} are not supported (text only)", param=param)
        texts.append(part.text)
    return "".join(texts)


def sampling_of(req: Any) -> dict[str, Any]:
    """The sampling options of a request, in ``Model.sampler`` terms."""
    out: dict[str, Any] = {}
    for key in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "seed"):
        value = getattr(req, key, None)
        if value is not None:
            out[key] = value
    if "seed" in out:
        out["seed"] %= 1 << 64
    bias = getattr(req, "logit_bias", None)
    if bias:
        try:
            out["logit_bias"] = {int(k): v for k, v in bias.items()}
        except ValueError:
            raise ApiError("logit_bias keys must be token ids", param="logit_bias") from None
    return out


def stops_of(stop: Any) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def format_grammar(kind: str | None, schema: Any, param: str) -> Grammar | None:
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if schema is None:
        raise ApiError("json_schema needs a schema", param=param)
    try:
        return Grammar.json_schema(schema)
    except (TypeError, ValueError) as e:
        raise ApiError(str(e), param=param) from None


def _usage(turn: Turn) -> dict[str, Any]:
    return {"prompt_tokens": turn.prompt_tokens, "completion_tokens": turn.completion_tokens,
            "total_tokens": turn.prompt_tokens + turn.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": turn.cached_tokens}}


class OpenAI:
    """The OpenAI endpoints over one ``Service``."""

    def __init__(self, service: Service, limits: Limits, *, stored_responses: int = 64):
        self.service, self.limits = service, limits
        self.created = int(time.time())
        self.stored: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()  # response id -> conversation
        self.max_stored = stored_responses

    def routes(self) -> list[Route]:
        return [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{name:path}", self.model, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
        ]

    # ---- helpers

    def _token(self, token: int) -> tuple[str, list[int]]:
        raw = self.service.model.tokenizer.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _logprob_entry(self, token: int, lp: float | None, top: list[tuple[int, float]] | None) -> dict[str, Any]:
        text, raw = self._token(token)
        entry: dict[str, Any] = {"token": text, "logprob": lp, "bytes": raw, "top_logprobs": []}
        for t, p in top or []:
            ttext, traw = self._token(t)
            entry["top_logprobs"].append({"token": ttext, "logprob": p, "bytes": traw})
        return entry


    def _messages(self, messages: list[schemas.ChatMessage]) -> list[dict[str, Any]]:
        out = []
        for i, m in enumerate(messages):
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                   "content": part_text(m.content, f"messages.{i}.content")}
            if m.tool_calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": c.function.arguments}} for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
            if m.reasoning_content:
                msg["reasoning_content"] = m.reasoning_content
            out.append(msg)
        return out

    # ---- models

    async def models(self, request: Request) -> Any:
        from starlette.responses import JSONResponse

        data = [{"id": name, "object": "model", "created": self.created, "owned_by": "lily"}
                for name in self.service.names()]
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> Any:
        from starlette.responses import JSONResponse

        name = request.path_params["name"]
        self.service.check_model(name)
        return JSONResponse({"id": name, "object": "model", "created": self.created, "owned_by": "lily"})

    # ---- chat completions

    async def chat(self, request: Request) -> Any:
        req = _validate(schemas.ChatRequest, parse_body(await request.body()))
        self.service.check_model(req.model)
        if req.n not in (None, 1):
            raise ApiError("only n = 1 is supported", param="n")
        if req.top_logprobs and not req.logprobs:
            raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
        kwargs = dict(req.chat_template_kwargs or {})
        taken = sorted(TEMPLATE_ARGUMENTS.intersection(kwargs))
        if taken:  # tokenize would make the template return token ids
            raise ApiError(f"chat_template_kwargs cannot set {taken[0]!r}: the request decides it",
                           param=f"chat_template_kwargs.{taken[0]}")
        thinking = kwargs.pop("enable_thinking", req.enable_thinking)
        if thinking is not None and not isinstance(thinking, bool):
            raise ApiError("enable_thinking must be true or false", param="chat_template_kwargs.enable_thinking")
        if thinking is None and req.reasoning_effort is not None:
            thinking = req.reasoning_effort not in _THINKING_OFF_EFFORTS
        choice = req.tool_choice
        tool_choice = choice.function.name if isinstance(choice, schemas.NamedToolChoice) else (choice or "auto")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        if tool_choice != "auto" and tool_choice != "none" and not tools:
            raise ApiError(f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
        fmt = req.response_format
        text = format_grammar(fmt.type, fmt.json_schema.schema_ if fmt and fmt.json_schema else None,
                              "response_format") if fmt else None
        plan = await self.service.prepare(
            self.service.prepare_chat, self._messages(req.messages), tools=tools, tool_choice=tool_choice,
            parallel_tool_calls=req.parallel_tool_calls is not False, thinking=thinking, template_kwargs=kwargs,
            text=text, max_tokens=req.max_completion_tokens or req.max_tokens, stop=stops_of(req.stop),
            sampling=sampling_of(req), logprobs=bool(req.logprobs), top_logprobs=req.top_logprobs or 0)
        job = self.service.start(plan)
        turn = Turn(plan, self.service)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        name = req.model or self.service.model_id
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStream(job, self._chat_events(job, turn, rid, created, name, usage))

        async def build() -> tuple[int, dict[str, Any]]:
            await collect(job, turn)
            message: dict[str, Any] = {"role": "assistant", "content": turn.parser.content or None}
            if turn.parser.reasoning_content:
                message["reasoning_content"] = turn.parser.reasoning_content
            if turn.tool_calls:
                message["tool_calls"] = turn.tool_calls
            logprobs = None
            if plan.logprobs:
                logprobs = {"content": [self._logprob_entry(*e) for e in turn.logprobs]}
            choice = {"index": 0, "message": message, "finish_reason": turn.finish_reason, "logprobs": logprobs}
            return 200, {"id": rid, "object": "chat.completion", "created": created, "model": name,
                         "choices": [choice], "usage": _usage(turn)}

        return WatchedJson(job, build)

    async def _chat_events(self, job: Job, turn: Turn, rid: str, created: int, name: str,
                           include_usage: bool) -> AsyncIterator[bytes]:
        def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]})

        yield chunk({"role": "assistant", "content": ""})
        try:
            async for event in job.events(heartbeat=self.limits.ping_interval):
                if event is HEARTBEAT:
                    yield b": ping\n\n"
                    continue
                deltas = turn.add(event)
                lp = None
                if turn.plan.logprobs and event.token is not None:
                    lp = {"content": [self._logprob_entry(event.token, event.logprob, event.top_logprobs)]}
                for d in deltas:
                    key = "reasoning_content" if d.kind == "reasoning" else "content"
                    yield chunk({key: d.text}, logprobs=lp)
                    lp = None
                if lp is not None:
                    yield chunk({}, logprobs=lp)
                if turn.done:
                    if turn.tool_calls:
                        yield chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(turn.tool_calls)]})
                    yield chunk({}, turn.finish_reason)
                    if include_usage:
                        yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                    "model": name, "choices": [], "usage": _usage(turn)})
        except Exception as e:
            yield _sse(engine_error(e).openai())
        yield b"data: [DONE]\n\n"

    # ---- completions

    async def completions(self, request: Request) -> Any:
        req = _validate(schemas.CompletionRequest, parse_body(await request.body()))
        self.service.check_model(req.model)
        if req.n not in (None, 1) or req.best_of not in (None, 1):
            raise ApiError("only n = 1 and best_of = 1 are supported", param="n")
        if req.echo or req.suffix:
            raise ApiError("echo and suffix are not supported", param="echo" if req.echo else "suffix")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError("one prompt per request", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError("prompt must not be empty", param="prompt")
        service = self.service

        def prepare() -> Plan:
            if isinstance(prompt, str):
                ids = service.tokenize(prompt, "prompt")
            else:
                ids = list(prompt)
                size = len(service.model.tokenizer)
                if any(not 0 <= t < size for t in ids):
                    raise ApiError(f"prompt token ids must be in [0, {size})", param="prompt")
            return service.plan(ids, thinking=False, tools=None, max_tokens=req.max_tokens or 16,
                                stop=stops_of(req.stop), sampling=sampling_of(req), grammar=None,
                                logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0)

        plan = await self.service.prepare(prepare)
        job = self.service.start(plan)
        turn = Turn(plan, self.service)
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        name = req.model or self.service.model_id
        base = {"id": rid, "object": "text_completion", "created": created, "model": name}
        texts: list[str] = []

        def logprobs_of(entries: list[Any], offset: int) -> dict[str, Any] | None:
            if not plan.logprobs:
                return None
            out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for token, lp, top in entries:
                text = self._token(token)[0]
                out["tokens"].append(text)
                out["token_logprobs"].append(lp)
                out["top_logprobs"].append({self._token(t)[0]: p for t, p in top or []})
                out["text_offset"].append(offset)
                offset += len(text)
            return out

        def feed(chunk: Any) -> str:
            turn.add(chunk)  # counts tokens, logprobs and the finish; completions keep the raw text
            texts.append(chunk.text)
            return chunk.text

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def events() -> AsyncIterator[bytes]:
                offset, seen = 0, 0
                try:
                    async for chunk in job.events(heartbeat=self.limits.ping_interval):
                        if chunk is HEARTBEAT:
                            yield b": ping\n\n"
                            continue
                        text = feed(chunk)
                        lp = logprobs_of(turn.logprobs[seen:], offset)
                        seen, offset = len(turn.logprobs), offset + len(text)
                        if text or chunk.finish_reason or lp:
                            yield _sse({**base, "choices": [{"index": 0, "text": text, "logprobs": lp,
                                                             "finish_reason": chunk.finish_reason}]})
                    if include_usage:
                        yield _sse({**base, "choices": [], "usage": _usage(turn)})
                except Exception as e:
                    yield _sse(engine_error(e).openai())
                yield b"data: [DONE]\n\n"

            return EventStream(job, events())

        async def build() -> tuple[int, dict[str, Any]]:
            try:
                async for chunk in job.events():
                    feed(chunk)
            except Exception as e:
                raise engine_error(e) from None
            choice = {"index": 0, "text": "".join(texts), "finish_reason": turn.finish_reason,
                      "logprobs": logprobs_of(turn.logprobs, 0)}
            return 200, {**base, "choices": [choice], "usage": _usage(turn)}

        return WatchedJson(job, build)

    # ---- responses

    def _conversation(self, req: schemas.ResponsesRequest) -> list[dict[str, Any]]:
        """The request's input (after the stored conversation it continues) as chat messages."""
        messages: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            if req.previous_response_id not in self.stored:
                raise ApiError(f"previous response {req.previous_response_id!r} not found (this server keeps "
                               f"the last {self.max_stored})", status=404, param="previous_response_id",
                               type="not_found_error")
            messages = [dict(m) for m in self.stored[req.previous_response_id]]
        if req.instructions:
            messages = [m for m in messages if m.get("role") != "system" or m.get("instructions") is not True]
            messages.insert(0, {"role": "system", "content": req.instructions, "instructions": True})
        items = [schemas.InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input
        reasoning = None
        for i, item in enumerate(items):
            if isinstance(item, schemas.ReasoningItem):
                reasoning = "".join(str(c.get("text", "")) for c in (item.content or []) if isinstance(c, dict))
            elif isinstance(item, schemas.InputMessage):
                role = "system" if item.role == "developer" else item.role
                msg: dict[str, Any] = {"role": role, "content": part_text(item.content, f"input.{i}.content")}
                if role == "assistant" and reasoning:
                    msg["reasoning_content"], reasoning = reasoning, None
                messages.append(msg)
            elif isinstance(item, schemas.FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                elif last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
                    last["tool_calls"] = [call]
                else:
                    msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                    if reasoning:
                        msg["reasoning_content"], reasoning = reasoning, None
                    messages.append(msg)
            else:
                output = item.output if isinstance(item.output, str) else part_text(item.output, f"input.{i}.output")
                messages.append({"role": "tool", "content": output, "tool_call_id": item.call_id})
        return messages

    async def responses(self, request: Request) -> Any:
        req = _validate(schemas.ResponsesRequest, parse_body(await request.body()))
        self.service.check_model(req.model)
        # Output-text logprobs are not produced here: asking for them is refused rather than answered with none.
        if req.top_logprobs:
            raise ApiError("logprobs are not available from /v1/responses here; use /v1/chat/completions",
                           param="top_logprobs")
        if "message.output_text.logprobs" in (req.include or []):
            raise ApiError("message.output_text.logprobs is not available from /v1/responses here; use "
                           "/v1/chat/completions", param="include")
        messages = self._conversation(req)
        template_messages = [{k: v for k, v in m.items() if k != "instructions"} for m in messages]
        thinking = None
        if req.reasoning is not None and req.reasoning.effort is not None:
            thinking = req.reasoning.effort not in _THINKING_OFF_EFFORTS
        choice = req.tool_choice
        tool_choice = choice.name if isinstance(choice, schemas.ResponseToolChoice) else (choice or "auto")
        tools = openai_tools([t.model_dump(exclude_none=True, exclude={"type"}) for t in req.tools or []])
        if tool_choice not in ("auto", "none") and not tools:
            raise ApiError(f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
        fmt = req.text.format if req.text else None
        text = format_grammar(fmt.type, fmt.schema_, "text.format") if fmt else None
        plan = await self.service.prepare(
            self.service.prepare_chat, template_messages, tools=tools, tool_choice=tool_choice,
            parallel_tool_calls=req.parallel_tool_calls is not False, thinking=thinking, text=text,
            max_tokens=req.max_output_tokens, sampling=sampling_of(req))
        job = self.service.start(plan)
        turn = Turn(plan, self.service)
        rid = f"resp_{uuid.uuid4().hex}"
        ids = {"reasoning": f"rs_{uuid.uuid4().hex}", "message": f"msg_{uuid.uuid4().hex}"}
        created = int(time.time())
        name = req.model or self.service.model_id
        echo = {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id":
                req.previous_response_id, "temperature": req.temperature, "top_p": req.top_p,
                "tool_choice": req.tool_choice.model_dump() if isinstance(choice, pydantic.BaseModel) else tool_choice,
                "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "metadata": req.metadata or {},
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
                "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
                "truncation": "disabled", "store": req.store is not False}

        def response(status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
            body = {"id": rid, "object": "response", "created_at": created, "status": status, "model": name,
                    "output": output, "error": None, "incomplete_details": None, "usage": None, **echo}
            if status in ("completed", "incomplete"):
                reasoning_tokens = 0 if not turn.parser.reasoning_content else len(
                    self.service.model.tokenizer.encode(turn.parser.reasoning_content))
                body["usage"] = {"input_tokens": turn.prompt_tokens,
                                 "input_tokens_details": {"cached_tokens": turn.cached_tokens},
                                 "output_tokens": turn.completion_tokens,
                                 "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                                 "total_tokens": turn.prompt_tokens + turn.completion_tokens}
            if status == "incomplete":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
            return body

        def final_output() -> list[dict[str, Any]]:
            out = []
            if turn.parser.reasoning_content:
                out.append({"type": "reasoning", "id": ids["reasoning"], "summary": [], "status": "completed",
                            "content": [{"type": "reasoning_text", "text": turn.parser.reasoning_content}]})
            if turn.parser.content or not turn.tool_calls:
                out.append(self._message_item(ids["message"], turn.parser.content, "completed"))
            for call in turn.tool_calls:
                out.append(self._call_item(call))
            return out

        def finish(output: list[dict[str, Any]]) -> dict[str, Any]:
            status = "incomplete" if turn.finish_reason == "length" else "completed"
            body = response(status, output)
            if req.store is not False:
                assistant: dict[str, Any] = {"role": "assistant", "content": turn.parser.content}
                if turn.parser.reasoning_content:
                    assistant["reasoning_content"] = turn.parser.reasoning_content
                if turn.tool_calls:
                    assistant["tool_calls"] = turn.tool_calls
                self.stored[rid] = [*messages, assistant]
                while len(self.stored) > self.max_stored:
                    self.stored.popitem(last=False)
            return body

        if req.stream:
            return EventStream(job, self._response_events(job, turn, response, finish, ids))

        async def build() -> tuple[int, dict[str, Any]]:
            await collect(job, turn)
            return 200, finish(final_output())

        return WatchedJson(job, build)

    @staticmethod
    def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def _call_item(call: dict[str, Any]) -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}

    async def _response_events(self, job: Job, turn: Turn, response, finish, ids) -> AsyncIterator[bytes]:
        seq = 0

        def emit(kind: str, **fields: Any) -> bytes:
            nonlocal seq
            payload = {"type": kind, "sequence_number": seq, **fields}
            seq += 1
            return _sse(payload, kind)

        output: list[dict[str, Any]] = []
        open_kind: str | None = None  # the item receiving deltas: "reasoning" or "message"
        text = {"reasoning": "", "message": ""}

        def close() -> list[bytes]:
            nonlocal open_kind
            if open_kind is None:
                return []
            index, kind, out = len(output) - 1, open_kind, []
            if kind == "reasoning":
                item = {"type": "reasoning", "id": ids["reasoning"], "summary": [], "status": "completed",
                        "content": [{"type": "reasoning_text", "text": text["reasoning"]}]}
                out.append(emit("response.reasoning_text.done", item_id=ids[kind], output_index=index,
                                content_index=0, text=text[kind]))
            else:
                item = self._message_item(ids[kind], text[kind], "completed")
                part = item["content"][0]
                out.append(emit("response.output_text.done", item_id=ids[kind], output_index=index,
                                content_index=0, text=text[kind], logprobs=[]))
                out.append(emit("response.content_part.done", item_id=ids[kind], output_index=index,
                                content_index=0, part=part))
            output[index] = item
            out.append(emit("response.output_item.done", output_index=index, item=item))
            open_kind = None
            return out

        def open_item(kind: str) -> list[bytes]:
            nonlocal open_kind
            out = close() if open_kind not in (None, kind) else []
            if open_kind == kind:
                return out
            index = len(output)
            if kind == "reasoning":
                item = {"type": "reasoning", "id": ids[kind], "summary": [], "status": "in_progress", "content": []}
                output.append(item)
                out.append(emit("response.output_item.added", output_index=index, item=item))
            else:
                item = {"type": "message", "id": ids[kind], "status": "in_progress", "role": "assistant",
                        "content": []}
                output.append(item)
                out.append(emit("response.output_item.added", output_index=index, item=item))
                out.append(emit("response.content_part.added", item_id=ids[kind], output_index=index, content_index=0,
                                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
            open_kind = kind
            return out

        yield emit("response.created", response=response("in_progress", []))
        yield emit("response.in_progress", response=response("in_progress", []))
        try:
            async for event in job.events(heartbeat=self.limits.ping_interval):
                if event is HEARTBEAT:
                    yield b": ping\n\n"
                    continue
                for d in turn.add(event):
                    kind = "reasoning" if d.kind == "reasoning" else "message"
                    for b in open_item(kind):
                        yield b
                    text[kind] += d.text
                    extra = {} if kind == "reasoning" else {"logprobs": []}
                    kind_name = "reasoning_text" if kind == "reasoning" else "output_text"
                    yield emit(f"response.{kind_name}.delta", item_id=ids[kind], output_index=len(output) - 1,
                               content_index=0, delta=d.text, **extra)
                if turn.done:
                    if not turn.tool_calls and not text["message"]:
                        for b in open_item("message"):
                            yield b
                    for b in close():
                        yield b
                    for call in turn.tool_calls:
                        item = self._call_item(call)
                        index = len(output)
                        output.append(item)
                        yield emit("response.output_item.added", output_index=index,
                                   item={**item, "arguments": "", "status": "in_progress"})
                        yield emit("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                   delta=item["arguments"])
                        yield emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   arguments=item["arguments"], name=item["name"])
                        yield emit("response.output_item.done", output_index=index, item=item)
                    body = finish(output)
                    yield emit("response.completed" if body["status"] == "completed" else "response.incomplete",
                               response=body)
        except Exception as e:
            err = engine_error(e)
            failed = response("failed", output)
            failed["error"] = {"code": err.code or err.type, "message": str(err)}
            yield emit("response.failed", response=failed)
