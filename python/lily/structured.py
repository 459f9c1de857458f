"""Structured output: grammars the sampler enforces token by token.

A ``Grammar`` (a JSON schema, a Lark grammar in llguidance's dialect, or a regex) is compiled by
llguidance in the native core into a mask of the ids allowed next; the sampler never draws any other
id, so the output matches the grammar by construction (not by retrying or repairing it afterwards).
The mask for the next token is computed on its own thread while the model runs the current one.

    model.generate("A user as JSON:", json_schema={"type": "object", "properties": {...}})
    model.generate("Date: ", grammar=re.compile(r"\\d{4}-\\d{2}-\\d{2}"))
    model.chat(messages, json_schema=schema)   # thinking stays free; the answer follows the schema

``tool_call_grammar`` builds the grammar of Qwen3.6's XML tool calls for a list of tools, which is how
the server enforces ``tool_choice: "required"``, a named function and ``strict`` tool parameters.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Union

__all__ = ["Grammar", "GrammarLike", "as_grammar", "tool_call_grammar"]

# The thinking part of a Qwen3.6 answer: anything up to the first `</think>`; then a little whitespace (bounded,
# as between tool calls: unbounded padding would let a model stall there forever).
_THINK_RULES = 'think[lazy]: /(?s:.*)<\\/think>/\nws: /[ \\t\\r\\n]{0,8}/\n'
# A name usable inside the grammar's string literals and the tool-call XML.
_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,128}\Z")


class Grammar:
    """What the output must match. Build one with ``Grammar.json_schema(schema)``, ``Grammar.json_object()``,
    ``Grammar.lark(text)`` (llguidance's Lark dialect: ``%json {...}``, ``[lazy]`` lexemes, ...) or
    ``Grammar.regex(pattern)`` (Rust ``regex`` syntax, matching the whole output)."""

    __slots__ = ("kind", "source")

    def __init__(self, kind: str, source: str):
        if kind not in ("json_schema", "lark", "regex", "llguidance"):
            raise ValueError(f"grammar kind must be json_schema, lark, regex or llguidance, got {kind!r}")
        if not isinstance(source, str):
            raise TypeError(f"grammar source must be a str, got {type(source).__name__}")
        self.kind, self.source = kind, source

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str | bool) -> Grammar:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(schema, (Mapping, bool)):
            raise TypeError(f"json_schema must be an object (dict), got {type(schema).__name__}")
        return cls("json_schema", json.dumps(_compact(schema)))

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def lark(cls, text: str) -> Grammar:
        return cls("lark", text)

    @classmethod
    def regex(cls, pattern: str | re.Pattern[str]) -> Grammar:
        return cls("regex", pattern.pattern if isinstance(pattern, re.Pattern) else pattern)

    def after_thinking(self) -> Grammar:
        """This grammar for the answer that follows free reasoning up to ``</think>`` (chat with thinking on:
        the prompt ends inside ``<think>``)."""
        if self.kind == "llguidance":
            raise ValueError("a grammar list cannot be nested after the thinking part")
        answer: dict[str, Any] = {"name": "answer"}
        if self.kind == "json_schema":
            answer["json_schema"] = json.loads(self.source)
        elif self.kind == "lark":
            answer["lark_grammar"] = self.source
        else:
            answer["lark_grammar"] = f"start: /{_regex_to_lark(self.source)}/"
        top = {"lark_grammar": "start: think ws @answer\n" + _THINK_RULES}
        return Grammar("llguidance", json.dumps({"grammars": [top, answer]}))

    def __repr__(self) -> str:
        text = self.source if len(self.source) <= 60 else self.source[:57] + "..."
        return f"Grammar.{self.kind}({text!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Grammar) and (self.kind, self.source) == (other.kind, other.source)

    def __hash__(self) -> int:
        return hash((self.kind, self.source))


GrammarLike = Union[Grammar, str, "re.Pattern[str]"]


def as_grammar(json_schema: Mapping[str, Any] | str | bool | None = None, grammar: GrammarLike | None = None
               ) -> Grammar | None:
    """The ``Grammar`` of the ``json_schema=`` / ``grammar=`` arguments (a str grammar is Lark, a compiled
    ``re.Pattern`` a regex); None when neither is given."""
    if json_schema is not None and grammar is not None:
        raise ValueError("pass json_schema= or grammar=, not both")
    if json_schema is not None:
        return Grammar.json_schema(json_schema)
    if grammar is None or isinstance(grammar, Grammar):
        return grammar
    if isinstance(grammar, re.Pattern):
        return Grammar.regex(grammar)
    if isinstance(grammar, str):
        return Grammar.lark(grammar)
    raise TypeError(f"grammar must be a lily.Grammar, a Lark str or a compiled regex, got {type(grammar).__name__}")


# JSON is written on one line with Python's separators (`{"a": 1, "b": [2, 3]}`): free whitespace would let
# a model pad forever between tokens, and a fixed layout is what a parser downstream gets anyway.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _compact(schema: Mapping[str, Any] | bool) -> Mapping[str, Any] | bool:
    """``schema`` with llguidance's one-line JSON layout, unless it sets its own ``x-guidance``."""
    if isinstance(schema, bool) or "x-guidance" in schema:
        return schema
    return {**schema, "x-guidance": _JSON_LAYOUT}


def _regex_to_lark(pattern: str) -> str:
    """``pattern`` usable inside Lark's ``/.../``: an unescaped ``/`` is escaped."""
    out, escaped = [], False
    for ch in pattern:
        if ch == "/" and not escaped:
            out.append("\\/")
        else:
            out.append(ch)
        escaped = ch == "\\" and not escaped
    return "".join(out)


def _literal(text: str) -> str:
    """A Lark string literal for ``text``."""
    return json.dumps(text, ensure_ascii=False)


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ValueError("each tool must have a function name")
    if not _NAME.match(fn["name"]):
        raise ValueError(f"tool name {fn['name']!r} must be 1-128 letters, digits, '_', '.', ':' or '-'")
    return fn


def _text_value(body: str = "(?s:.*)") -> str:
    """A lazy lexeme: raw text matching ``body`` and the tag that closes the parameter (lazy: it ends at
    the first closing tag, so the value never contains one)."""
    return f"/{body}\\n<\\/parameter>\\n/"


def _value(schema: Any) -> tuple[str, bool]:
    """The grammar of one parameter value and the tag closing it, as the chat template writes them (raw
    text for strings, JSON for everything else), and whether it is a lazy lexeme (a rule of its own)."""
    close = _literal("\n</parameter>\n")
    if not isinstance(schema, Mapping):
        return _text_value(), True
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    enum = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(_literal(v) for v in enum) + ") " + close, False
    if "string" in types or (types == [None] and not any(k in schema for k in ("properties", "items", "anyOf"))):
        pattern = schema.get("pattern")
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        if types == ["string"] and isinstance(pattern, str) and pattern.startswith("^") and pattern.endswith("$"):
            return _text_value(f"(?:{_regex_to_lark(pattern[1:-1])})"), True
        if types == ["string"] and isinstance(lo, int) and (hi is None or isinstance(hi, int)) and (lo or hi):
            return _text_value(f"(?s:.{{{max(lo, 0)},{'' if hi is None else max(hi, 0)}}})"), True
        return _text_value(), True
    return "%json " + json.dumps(_compact(schema)) + " " + close, False


def _answer(choice: str, parallel: bool, text: Grammar | None) -> str:
    """The answer rule of ``tool_call_grammar``."""
    more = " (ws call)*" if parallel else ""
    if choice == "auto" and text is not None:
        return f"%json {text.source} | call{more}"
    if choice == "auto":
        return f"FREE | pre fns{more}"
    return f"call{more}" if choice == "required" else "call"


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], *, choice: str = "auto", thinking: bool = False,
                      parallel: bool = True, text: Grammar | None = None) -> Grammar:
    """The Qwen3.6 tool-call XML of ``tools`` (OpenAI function tools, or ``{name, parameters}``), as a grammar.

    ``choice`` is "required" (one or more calls and nothing else), "auto" (free text, or text followed by
    calls) or a function name (one call of that function); ``parallel=False`` allows one call only.
    Parameters follow each tool's JSON schema: required ones always present, optional ones in schema
    order, string values as raw text, other values as JSON. With ``thinking``, free reasoning up to
    ``</think>`` comes first. ``text`` (a JSON-schema grammar, with ``choice="auto"``) replaces the free
    text: the answer is either that JSON or tool calls.
    """
    if text is not None and (text.kind != "json_schema" or choice != "auto"):
        raise ValueError("tool_call_grammar: text= must be a JSON schema, with choice='auto'")
    functions = [_function(t) for t in tools]
    if not functions:
        raise ValueError("tool_call_grammar needs at least one tool")
    names = [fn["name"] for fn in functions]
    if choice not in ("auto", "required") and choice not in names:
        raise ValueError(f"tool_choice names {choice!r}, which is not among the tools ({', '.join(names)})")
    nl = "\n"
    rules: list[str] = []
    alternatives: list[str] = []
    for i, fn in enumerate(functions):
        if choice not in ("auto", "required") and fn["name"] != choice:
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        if not isinstance(props, Mapping):
            props = {}
        required = params.get("required", []) if isinstance(params, Mapping) else []
        required = [r for r in required if isinstance(r, str)] if isinstance(required, list) else []
        parts: list[str] = []
        for j, (pname, pschema) in enumerate(props.items()):
            if not isinstance(pname, str) or not _NAME.match(pname):
                raise ValueError(f"tool {fn['name']!r}: parameter name {pname!r} cannot be written in a tool call")
            value, lazy = _value(pschema)
            if lazy:
                rules.append(f"v{i}_{j}[lazy]: {value}")
                value = f"v{i}_{j}"
            rules.append(f"p{i}_{j}: {_literal(f'<parameter={pname}>' + nl)} {value}")
            parts.append(f"p{i}_{j}" if pname in required else f"p{i}_{j}?")
        closed = isinstance(params, Mapping) and params.get("additionalProperties") is False
        body = " ".join(parts) + ("" if closed else " any_param*")
        head = _literal("<function=" + fn["name"] + ">" + nl)
        rules.append(f"f{i}: {head} {body} {_literal('</function>' + nl + '</tool_call>')}")
        alternatives.append(f"f{i}")
    lines = [
        "start: think ws answer" if thinking else "start: answer",
        f"answer: {_answer(choice, parallel, text)}",
        f"call: {_literal('<tool_call>' + nl)} fns",
        "fns: " + " | ".join(alternatives),
        *rules,
        f"any_param: {_literal('<parameter=')} /[A-Za-z0-9_.:\\-]+/ {_literal('>' + nl)} text_value",
        f"text_value[lazy]: {_text_value()}",
        _THINK_RULES.splitlines()[1],
    ]
    if choice == "auto" and text is None:
        # Free text without a tool call, or text up to the first `<tool_call>` and the calls from there.
        lines += ["FREE: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/", "pre[lazy]: /(?s:.*)<tool_call>\\n/"]
    if thinking:
        lines.append(_THINK_RULES.splitlines()[0])

    return Grammar.lark("\n".join(lines) + "\n")
