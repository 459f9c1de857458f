"""Tool calls: Qwen3.6's XML calls parsed into OpenAI-style dicts, and OpenAI-style calls made ready for the
chat template.

Qwen3.6 calls tools in this format (the chat template shows it to the model)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Each well-formed block becomes ``{"id": ..., "type": "function", "function": {"name": ...,
"arguments": "<JSON object>"}}``. Parameter values are strings unless the tool's JSON schema types
them (integer, number, boolean, object, array, null), in which case they are converted when they fit
(a value that does not stays a string, so ``arguments`` is always valid JSON). A block that does not
parse stays in the content as text: parsing never raises and runs in time linear in the text.
"""

from __future__ import annotations

import ast
import json
import math
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["parse_tool_calls", "tool_call_arguments_as_mappings"]

def _param_types(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """function name -> {parameter name -> JSON-schema type (str or list)}"""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        if not isinstance(tool, Mapping):
            continue
        fn = tool.get("function", tool)
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        types: dict[str, Any] = {}
        if isinstance(props, Mapping):
            for name, schema in props.items():
                if isinstance(schema, Mapping):
                    types[name] = schema.get("type", "string")
        out[fn["name"]] = types
    return out


_NOT_JSON = object()


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` as plain JSON data (tuples become lists), or ``_NOT_JSON`` if it has anything else (a
    non-str key, a non-finite float, a set, bytes, nesting past 64 levels)."""
    if depth > 64:
        return _NOT_JSON
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            v = _plain(v, depth + 1)
            if not isinstance(k, str) or v is _NOT_JSON:
                return _NOT_JSON
            out[k] = v
        return out
    if isinstance(value, (list, tuple)):
        items = [_plain(v, depth + 1) for v in value]
        return _NOT_JSON if any(v is _NOT_JSON for v in items) else items
    if isinstance(value, float) and not math.isfinite(value):
        return _NOT_JSON
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    return _NOT_JSON


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _structured(text: str, kind: type) -> Any:
    """``text`` as a JSON (or, as Qwen sometimes writes it, Python-literal) object or array, or None."""
    for parse in (lambda t: json.loads(t, parse_constant=_reject_constant), ast.literal_eval):
        try:
            value = parse(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        value = _plain(value)
        if isinstance(value, kind):
            return value
    return None


def _convert(value: str, schema_type: Any) -> Any:
    """A parameter's text as the schema type says, or the text itself when it does not fit (so the
    arguments are always valid JSON)."""
    types = schema_type if isinstance(schema_type, list) else [schema_type]
    types = [t for t in types if isinstance(t, str)]
    if not types or "string" in types:
        return value
    stripped = value.strip()
    for t in types:
        try:
            if t == "integer":
                return int(stripped)
            if t == "number":
                number = float(stripped)
                if not math.isfinite(number):
                    continue
                return int(number) if number.is_integer() and "." not in stripped and "e" not in stripped else number
        except (ValueError, OverflowError):
            continue
        if t == "boolean" and stripped.lower() in ("true", "false"):
            return stripped.lower() == "true"
        if t == "null" and stripped.lower() in ("null", "none"):
            return None
        if t in ("object", "array"):
            parsed = _structured(stripped, dict if t == "object" else list)
            if parsed is not None:
                return parsed
    return value


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _parse_call(text: str, pos: int, types: dict[str, dict[str, Any]]) -> tuple[dict[str, Any] | None, int]:
    """The call whose ``<tool_call>`` ends at ``pos``: ``<function=NAME>``, parameters, ``</function>``,
    ``</tool_call>`` (which may be missing at the very end of the text). Returns the OpenAI call and the
    position after it, or None and the position where the format broke; never reads back before
    ``pos``, so scanning a text block after block is linear."""
    head = "<function="
    pos = _skip_space(text, pos)
    if not text.startswith(head, pos):
        return None, pos
    gt = text.find(">", pos)
    if gt < 0:
        return None, len(text)
    name = text[pos + len(head) : gt].strip()
    if not name or "\n" in name or "<" in name:
        return None, gt
    schema = types.get(name, {})
    args: dict[str, Any] = {}
    pos = gt + 1
    while True:
        pos = _skip_space(text, pos)
        if text.startswith("</function>", pos):
            break
        if not text.startswith("<parameter=", pos):
            return None, pos  # stray text
        gt = text.find(">", pos)
        close = text.find("</parameter>", gt + 1) if gt >= 0 else -1
        if close < 0:
            return None, len(text)
        pname = text[pos + len("<parameter=") : gt].strip()
        if not pname or "\n" in pname or "<" in pname:
            return None, gt
        value = text[gt + 1 : close]
        # The template writes "<parameter=NAME>\n" + value + "\n</parameter>": drop that one newline each side.
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        args[pname] = _convert(value, schema.get(pname, "string"))
        pos = close + len("</parameter>")
    pos = _skip_space(text, pos + len("</function>"))
    if text.startswith("</tool_call>", pos):
        pos += len("</tool_call>")
    elif pos < len(text):
        return None, pos
    call = {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False, allow_nan=False)},
    }
    return call, pos


def parse_tool_calls(
    text: str, tools: Sequence[Mapping[str, Any]] | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """Take the well-formed ``<tool_call>`` blocks out of ``text``.

    Returns ``(content, tool_calls)``: the text with the parsed blocks removed (and stripped), and the
    calls in OpenAI format (``arguments`` is a JSON object as a string, always valid JSON: a value that
    does not fit its schema type stays a string). Malformed blocks stay in the content, as does a call
    cut off before ``</function>`` (one cut after it, at the end of the text, counts). Never raises;
    one forward scan (a malformed block is resumed from where it broke), so linear in ``len(text)``.
    """
    if not isinstance(text, str) or "<tool_call>" not in text:
        return text, []
    types = _param_types(tools)
    open_tag = "<tool_call>"
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = scan = 0
    while True:
        start = text.find(open_tag, scan)
        if start < 0:
            break
        call, end = _parse_call(text, start + len(open_tag), types)
        if call is None:
            scan = max(end, start + len(open_tag))
            continue
        kept.append(text[pos:start])
        calls.append(call)
        pos = scan = end
    kept.append(text[pos:])
    if not calls:
        return text, []
    return "".join(kept).strip(), calls


def tool_call_arguments_as_mappings(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the ``arguments`` of OpenAI-style tool calls, a JSON string, parsed into the mapping
    the chat template wants (arguments that are not valid JSON stay as they are)."""
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
                        except (json.JSONDecodeError, RecursionError):  # RecursionError: nested past Python's limit
                            pass
                        call["function"] = fn
                fixed.append(call)
            m["tool_calls"] = fixed
        out.append(m)
    return out
