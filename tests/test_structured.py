"""Structured output: grammars enforced by masking the logits each step (llguidance in the native core).

A random-weight checkpoint makes unconstrained output noise, so every schema-valid output below is the
grammar's doing; the same prompts without a schema are checked to be invalid.
"""

from __future__ import annotations

import json
import re

import jsonschema
import lily
import pytest
from lily.structured import Grammar, tool_call_grammar

SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "b": {"enum": ["x", "y", "z"]}}, "required": ["a", "b"]},
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "ok": {"type": "boolean"}}, "required": ["name", "tags", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                      "n": {"type": "null"}}, "required": ["code", "n"]},
    {"anyOf": [{"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 9}},
                "required": ["kind", "r"], "additionalProperties": False},
               {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer",
                                                                                      "maximum": 50}},
                "required": ["kind", "side"], "additionalProperties": False}]},
    {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 3,
     "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                          "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                         "required": ["x", "y"], "additionalProperties": False}}},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"},
                                      "level": {"type": "integer", "enum": [1, 2, 3]}},
     "required": ["when", "level"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import fixtures

    folder = tmp_path_factory.mktemp("structured") / "ckpt"
    fixtures.write_hf_checkpoint(folder, preset="tiny", seed=3, real_tokenizer=True)
    return lily.load(folder, backend="cpu", max_seq=2048, progress=False)


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_output_follows_its_schema(model, index):
    schema = SCHEMAS[index]
    for seed in range(4):
        out = model.generate(f"Answer {index}:", json_schema=schema, max_tokens=400, temperature=1.0, seed=seed)
        assert out.finish_reason == "stop", f"seed {seed}: cut off: {out!r}"
        jsonschema.validate(json.loads(out), schema)


def test_without_the_schema_the_same_model_writes_no_json(model):
    """The test above has teeth: unconstrained, these prompts give noise."""
    for index in range(len(SCHEMAS)):
        out = model.generate(f"Answer {index}:", max_tokens=40, temperature=1.0, seed=0)
        with pytest.raises(ValueError):
            json.loads(out)


def test_regex_and_lark_grammars(model):
    date = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
    lark = 'start: greeting " " NAME "!"\ngreeting: "hello" | "hi"\nNAME: /[a-z]{1,8}/\n'
    for seed in range(3):
        out = model.generate("Date:", grammar=date, max_tokens=30, temperature=1.0, seed=seed)
        assert date.fullmatch(out), out
        out = model.generate("Greet:", grammar=lark, max_tokens=30, temperature=1.0, seed=seed)
        assert re.fullmatch(r"(hello|hi) [a-z]{1,8}!", out), out
        out = model.generate("Greet:", grammar=Grammar.json_object(), max_tokens=30, temperature=0.0, seed=seed)
        assert out.finish_reason == "length" or isinstance(json.loads(out), dict)


def test_streaming_and_chat_follow_the_schema(model):
    schema = SCHEMAS[0]
    text = "".join(c.text for c in model.stream("Go:", json_schema=schema, max_tokens=100, seed=1))
    jsonschema.validate(json.loads(text), schema)
    msg = model.chat([{"role": "user", "content": "Give me a and b."}], enable_thinking=False, json_schema=schema,
                     max_tokens=100, seed=2)
    jsonschema.validate(json.loads(msg.content), schema)


def test_after_thinking_the_answer_is_constrained(model):
    """With thinking on, the reasoning is free up to `</think>` and the answer follows the grammar."""
    tok = model.tokenizer
    c = model.constrain(Grammar.json_schema(SCHEMAS[0]).after_thinking())
    for t in tok.encode("I should answer with a JSON object.</think>\n\n"):
        assert c.allows(t)
        lily.Sampler(temperature=0).sample(_onehot(model, t), constraint=c)
    assert c.allows(tok.encode("{")[0]) and not c.allows(tok.encode("Sure")[0])


def test_tool_call_grammar_gives_parseable_calls(model):
    tools = [{"type": "function", "function": {"name": "set_alarm", "parameters": {
        "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                         "label": {"type": "string", "maxLength": 10},
                                         "days": {"type": "array", "items": {"enum": ["mon", "tue"]}, "maxItems": 2}},
        "required": ["hour", "label"], "additionalProperties": False}}},
        {"type": "function", "function": {"name": "stop", "parameters": {"type": "object", "properties": {},
                                                                         "additionalProperties": False}}}]
    for choice in ("required", "set_alarm"):
        for seed in range(3):
            out = model.generate("Call:", grammar=tool_call_grammar(tools, choice=choice), max_tokens=300,
                                 temperature=1.0, seed=seed)
            content, calls = lily.parse_tool_calls(out, tools)
            if choice == "set_alarm":  # exactly one call, then the end
                assert out.finish_reason == "stop" and len(calls) == 1 and content == "", out
            else:  # one call or more (a random model may go on calling until max_tokens: the last one is cut)
                assert calls and (content == "" or content.startswith("<tool_call>")), out
            for call in calls:
                args = json.loads(call["function"]["arguments"])
                if choice == "set_alarm":
                    assert call["function"]["name"] == "set_alarm"
                if call["function"]["name"] == "set_alarm":
                    jsonschema.validate(args, tools[0]["function"]["parameters"])
                else:
                    assert args == {}


def test_bad_grammars_are_value_errors(model):
    with pytest.raises(ValueError, match="grammar"):
        model.generate("x", json_schema={"type": "no-such-type"}, max_tokens=5)
    with pytest.raises(ValueError, match="grammar"):
        model.generate("x", grammar="start: missing_rule", max_tokens=5)
    with pytest.raises(ValueError, match="not both"):
        model.generate("x", json_schema={}, grammar="start: \"a\"", max_tokens=5)
    with pytest.raises(TypeError):
        model.generate("x", grammar=42, max_tokens=5)
    with pytest.raises(ValueError, match="not among the tools"):
        tool_call_grammar([{"name": "a"}], choice="b")


def _onehot(model, token):
    import numpy as np

    row = np.zeros(model.engine.vocab_size, dtype=np.float32)
    row[token] = 100.0
    return row
