"""Chat template rendering: identical to transformers' apply_chat_template (golden file + live comparison)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import fixtures
import pytest
from lily.model import Model
from lily.template import ChatTemplate, TemplateError
from lily.tokenizer import Tokenizer

QWEN = fixtures.qwen_tokenizer_dir()

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city (°C, \"quoted\", <tags> & ünïcode).",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}

CASES = [
    ("plain", [{"role": "user", "content": "Hi"}], None, {}),
    ("thinking_off", [{"role": "user", "content": "Hi"}], None, {"enable_thinking": False}),
    ("no_gen_prompt", [{"role": "user", "content": "Hi"}], None, {"add_generation_prompt": False}),
    (
        "system_and_content_parts",
        [
            {"role": "system", "content": [{"type": "text", "text": "  Be brief.  "}]},
            {"role": "user", "content": [{"type": "text", "text": "part one "}, {"type": "text", "text": "two"}]},
        ],
        None,
        {},
    ),
    (
        "think_tags_in_content",
        [
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nanswer one"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "<think>\nnew reasoning\n</think>\n\nanswer two"},
        ],
        None,
        {"add_generation_prompt": False},
    ),
    (
        "preserve_thinking",
        [
            {"role": "user", "content": "q1"},
            {"role": "assistant", "reasoning_content": "r1", "content": "a1"},
            {"role": "user", "content": "q2"},
        ],
        None,
        {"preserve_thinking": True, "enable_thinking": True},
    ),
    (
        "reasoning_alias_fields",
        [
            {"role": "user", "content": "q1"},
            {"role": "assistant", "thinking": "via thinking", "content": "a1"},
        ],
        None,
        {"add_generation_prompt": False},
    ),
    (
        "tools_multi_call_and_responses",
        [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Weather in Paris and Tokyo, then search news."},
            {
                "role": "assistant",
                "content": "Let me check.",
                "reasoning_content": "two calls",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    {"name": "get_weather", "arguments": {"city": "東京", "days": 3, "opts": {"a": [1, "x"]}}},
                ],
            },
            {"role": "tool", "content": '{"temp": 18}'},
            {"role": "tool", "content": '{"temp": 25}'},
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "search", "arguments": {}}}]},
            {"role": "tool", "content": "no news"},
        ],
        [WEATHER, SEARCH],
        {},
    ),
    (
        "tool_then_final_answer_preserved",
        [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
            },
            {"role": "tool", "content": "cold"},
            {"role": "assistant", "content": "It is cold.", "reasoning_content": "tool said cold"},
            {"role": "user", "content": "Thanks"},
        ],
        [WEATHER],
        {"enable_thinking": False, "preserve_thinking": True},
    ),
]


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    tpl = ChatTemplate.from_dir(QWEN)
    assert tpl is not None
    return tpl


@pytest.fixture(scope="module")
def model() -> Model:
    tok = Tokenizer.from_file(QWEN / "tokenizer.json", eos_ids=[248046, 248044])
    return Model(None, tok, ChatTemplate.from_dir(QWEN), {})  # no engine needed to render


@pytest.fixture(scope="module")
def hf():
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(QWEN))


GOLDEN = json.loads((Path(__file__).parent / "data" / "qwen3.6-chat-examples.json").read_text(encoding="utf-8"))


def _examples():
    return GOLDEN["examples"]


def test_shipped_files_are_the_ones_the_goldens_were_made_with():
    for name, key in (("chat_template.jinja", "chat_template_sha256"), ("tokenizer.json", "tokenizer_json_sha256")):
        assert hashlib.sha256((QWEN / name).read_bytes()).hexdigest() == GOLDEN[key], name


@pytest.mark.parametrize("example", _examples(), ids=lambda e: e["name"])
def test_golden_examples(model, example):
    kwargs = dict(example["kwargs"])
    agp = kwargs.pop("add_generation_prompt", False)
    text = model.apply_chat_template(example["messages"], tools=example["tools"], add_generation_prompt=agp, **kwargs)
    assert text == example["rendered"]
    ids = model.apply_chat_template(
        example["messages"], tools=example["tools"], add_generation_prompt=agp, tokenize=True, **kwargs
    )
    assert ids == example["token_ids"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_matches_transformers(model, hf, case):
    _, messages, tools, kwargs = case
    kwargs = dict(kwargs)
    agp = kwargs.pop("add_generation_prompt", True)
    want = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=agp, tokenize=False, **kwargs)
    got = model.apply_chat_template(messages, tools=tools, add_generation_prompt=agp, **kwargs)
    assert got == want
    want_ids = hf.apply_chat_template(
        messages, tools=tools, add_generation_prompt=agp, tokenize=True, return_dict=False, **kwargs
    )
    got_ids = model.apply_chat_template(messages, tools=tools, add_generation_prompt=agp, tokenize=True, **kwargs)
    assert got_ids == list(want_ids)


def test_template_errors_are_typed(model, hf):
    import jinja2

    for messages in (
        [{"role": "assistant", "content": "no user"}],
        [{"role": "user", "content": "x"}, {"role": "system", "content": "late system"}],
        [{"role": "robot", "content": "x"}],
    ):
        with pytest.raises(jinja2.exceptions.TemplateError):
            hf.apply_chat_template(messages, tokenize=False)
        with pytest.raises(TemplateError):
            model.apply_chat_template(messages)
    with pytest.raises(ValueError):
        model.apply_chat_template([])


def test_template_from_tokenizer_config(tmp_path, template):
    shutil.copy(QWEN / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    tpl = ChatTemplate.from_dir(tmp_path)
    msgs = [{"role": "user", "content": "Hi"}]
    assert tpl.render(msgs, add_generation_prompt=True) == template.render(msgs, add_generation_prompt=True)
    assert ChatTemplate.from_dir(tmp_path / "missing") is None


def test_sandbox_and_helpers():
    tpl = ChatTemplate(
        "{{ messages[0].content | tojson }}|{{ raise_exception is defined }}|{{ strftime_now('%Y') | length }}"
        "{% set ns = namespace(x=1) %}{% for i in range(3) %}{% if i == 1 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    )
    assert tpl.render([{"role": "user", "content": "<é>"}]) == '"<é>"|True|40'
    evil = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception):  # noqa: B017 - the sandbox's SecurityError
        evil.render([{"role": "user", "content": "x"}])
