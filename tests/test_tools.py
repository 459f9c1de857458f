"""Qwen3.6 tool-call parsing under fuzzing: it never raises, every call's ``arguments`` is valid JSON, a
rendered call parses back to its arguments, and adversarial inputs take linear time."""

from __future__ import annotations

import json
import time

from hypothesis import given
from hypothesis import strategies as st
from lily.tools import parse_tool_calls

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"},
    "o": {"type": "object"}, "a": {"type": "array"}, "z": {"type": "null"}, "u": {"type": ["integer", "null"]}}}}}]

# Text built from the pieces of the format, so the fuzzer reaches deep into the grammar quickly.
PIECES = ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", ">", "\n",
          "f", "s", "i", "n", "b", "o", "a", "z", "u", "1", "-2.5e3", "NaN", "Infinity", "1e999", "true", "None",
          "{", "}", "[", "]", '"', "'", ",", ":", " ", "x", "é", "\\", "(", ")", "1j", "b''", "{1, 2}", "\x00"]
texts = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=5)), max_size=60).map("".join)


def strict_json(text):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


@given(texts, st.booleans())
def test_never_raises_and_arguments_are_json_objects(text, with_tools):
    content, calls = parse_tool_calls(text, TOOLS if with_tools else None)
    assert isinstance(content, str)
    for call in calls:
        assert call["type"] == "function" and call["function"]["name"]
        assert isinstance(strict_json(call["function"]["arguments"]), dict)
    if not calls:
        assert content == text


values = st.one_of(
    st.text().filter(lambda s: "</parameter>" not in s),
    st.integers(-10**30, 10**30),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
)
SCHEMA_TYPE = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null", list: "array",
               dict: "object"}


@given(st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True), values, max_size=5))
def test_a_rendered_call_parses_back(args):
    """As the chat template writes a call (JSON for non-strings), parsing gives the arguments back."""
    props = {k: {"type": SCHEMA_TYPE[type(v)]} for k, v in args.items()}
    tools = [{"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": props}}}]
    body = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                   for k, v in args.items())
    text = f"Let me call it.\n\n<tool_call>\n<function=g>\n{body}</function>\n</tool_call>"
    content, calls = parse_tool_calls(text, tools)
    assert content == "Let me call it." and len(calls) == 1
    got = strict_json(calls[0]["function"]["arguments"])
    assert got == args


def test_values_that_do_not_fit_stay_strings():
    call = ("<tool_call>\n<function=f>\n<parameter=i>\n12x\n</parameter>\n<parameter=n>\nNaN\n</parameter>\n"
            "<parameter=o>\n{'a': (1, 2), 'b': {1, 2}}\n</parameter>\n<parameter=a>\n[1e999]\n</parameter>\n"
            "<parameter=b>\nyes\n</parameter>\n<parameter=z>\n[[[[\n</parameter>\n</function>\n</tool_call>")
    args = strict_json(parse_tool_calls(call, TOOLS)[1][0]["function"]["arguments"])
    assert args == {"i": "12x", "n": "NaN", "o": "{'a': (1, 2), 'b': {1, 2}}", "a": "[1e999]", "b": "yes",
                    "z": "[[[["}
    # Python-literal objects, as the model sometimes writes them, are converted when they are plain data.
    call = call.replace("{'a': (1, 2), 'b': {1, 2}}", "{'a': (1, 2), 'b': True}")
    assert strict_json(parse_tool_calls(call, TOOLS)[1][0]["function"]["arguments"])["o"] == {"a": [1, 2], "b": True}


def test_a_call_cut_before_its_closing_tag_still_counts():
    text = "<tool_call>\n<function=f>\n<parameter=s>\nhi\n</parameter>\n</function>\n"
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "" and json.loads(calls[0]["function"]["arguments"]) == {"s": "hi"}


def test_adversarial_inputs_take_linear_time():
    """Inputs of 2 MB that make a backtracking or rescanning parser quadratic (minutes at this size)."""
    n = 2_000_000
    cases = [
        "<tool_call>" * (n // 11),
        "<tool_call>\n<function=f>\n" + "<parameter=s>\n" * (n // 14),
        "<tool_call>\n<function=f>\n" + "<parameter=s>\nx\n</parameter>\n" * (n // 30),
        ("<tool_call>\n<function=f>\n</function>\n" * (n // 36)) + "</tool_call>",
        "<tool_call>" + "<function=" * (n // 10),
        "<tool_call>\n<function=f>\n<parameter=o>\n" + "[" * (n // 2) + "\n</parameter>\n</function>\n</tool_call>",
    ]
    for text in cases:
        t0 = time.perf_counter()
        parse_tool_calls(text, TOOLS)
        assert time.perf_counter() - t0 < 5.0, text[:60]
