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
them (integer, number, boolean, object, array, null), in which case they are converted. A block that
does not parse stays in the content as text: parsing never raises.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["parse_tool_calls", "tool_call_arguments_as_mappings"]

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION = re.compile(r"\A\s*<function=([^>\n]+)>(.*)</function>\s*\Z", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


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


def _convert(value: str, schema_type: Any) -> Any:
    """A parameter's text as the schema type says, or the text itself when it does not fit."""
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
                return int(number) if number.is_integer() and "." not in stripped and "e" not in stripped else number
            if t == "boolean":
                if stripped.lower() in ("true", "false"):
                    return stripped.lower() == "true"
                continue
            if t == "null":
                if stripped.lower() in ("null", "none"):
                    return None
                continue
            if t in ("object", "array"):
                try:
                    return json.loads(stripped)
                except json.JSONDecodeError:
                    return ast.literal_eval(stripped)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return value


def _parse_block(body: str, types: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    m = _FUNCTION.match(body)
    if m is None:
        return None
    name, inner = m.group(1).strip(), m.group(2)
    if not name:
        return None
    args: dict[str, Any] = {}
    pos = 0
    for p in _PARAMETER.finditer(inner):
        if inner[pos : p.start()].strip():
            return None  # stray text between parameters
        pos = p.end()
        value = p.group(2)
        # The template writes "<parameter=NAME>\n" + value + "\n</parameter>": drop that one newline each side.
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        args[p.group(1).strip()] = _convert(value, types.get(name, {}).get(p.group(1).strip(), "string"))
    if inner[pos:].strip():
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
    }


def parse_tool_calls(
    text: str, tools: Sequence[Mapping[str, Any]] | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """Take the well-formed ``<tool_call>`` blocks out of ``text``.

    Returns ``(content, tool_calls)``: the text with the parsed blocks removed (and stripped), and the
    calls in OpenAI format (``arguments`` is a JSON string). Malformed blocks, and an unclosed
    ``<tool_call>``, are left in the content.
    """
    if "<tool_call>" not in text:
        return text, []
    types = _param_types(tools)
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for m in _TOOL_CALL.finditer(text):
        call = _parse_block(m.group(1), types)
        if call is None:
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append(call)
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
                        except json.JSONDecodeError:
                            pass
                        call["function"] = fn
                fixed.append(call)
            m["tool_calls"] = fixed
        out.append(m)
    return out
