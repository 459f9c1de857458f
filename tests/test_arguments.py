"""Typed errors for bad input outside the weights: a malformed or unreadable side file of a checkpoint
(``tokenizer_config.json``, ``chat_template.jinja``, ``generation_config.json``) is a ``ModelLoadError`` naming
the file, at load; a wrong argument to a public function is a ``TypeError`` (wrong type) or ``ValueError`` (bad
value) naming the argument, never an ``AttributeError`` or a comparison error from inside the library, and
never silently accepted (a float ``max_tokens``, ``do_sample: "false"``, bytes as a prompt).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import lily
import numpy as np
import pytest

MESSAGES = [{"role": "user", "content": "hi"}]


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.fixture(scope="module")
def model(tiny_hf):
    return lily.load(tiny_hf, backend="cpu", max_seq=256, progress=False)


@pytest.fixture
def ckpt(tmp_path, tiny_hf):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_hf, dst)
    return dst


# --------------------------------------------------------------------------------------------------
# side files


def _gen_config(**changes):
    def edit(folder):
        path = folder / "generation_config.json"
        cfg = json.loads(path.read_text())
        cfg.update(changes)
        path.write_text(json.dumps(cfg))

    return edit


SIDE_FILES = {
    "tokenizer_config not json": ("tokenizer_config.json", lambda f: (f / "tokenizer_config.json").write_text("{")),
    "tokenizer_config a list": ("tokenizer_config.json", lambda f: (f / "tokenizer_config.json").write_text("[]")),
    "tokenizer_config bad utf-8": ("tokenizer_config.json",
                                   lambda f: (f / "tokenizer_config.json").write_bytes(b'{"a": "\xff"}')),
    "tokenizer_config chat_template 5": ("tokenizer_config.json", lambda f: (
        (f / "chat_template.jinja").unlink(), (f / "tokenizer_config.json").write_text('{"chat_template": 5}'))),
    "tokenizer_config chat_template list": ("tokenizer_config.json", lambda f: (
        (f / "chat_template.jinja").unlink(),
        (f / "tokenizer_config.json").write_text('{"chat_template": [{"name": "default"}]}'))),
    "tokenizer_config template syntax": ("tokenizer_config.json", lambda f: (
        (f / "chat_template.jinja").unlink(),
        (f / "tokenizer_config.json").write_text('{"chat_template": "{% if %}"}'))),
    "chat_template syntax": ("chat_template.jinja",
                             lambda f: (f / "chat_template.jinja").write_text("{% for m in messages %}")),
    "chat_template bad utf-8": ("chat_template.jinja", lambda f: (f / "chat_template.jinja").write_bytes(b"\xc3(")),
    "generation_config not json": ("generation_config.json",
                                   lambda f: (f / "generation_config.json").write_text("nope")),
    "generation_config a list": ("generation_config.json", lambda f: (f / "generation_config.json").write_text("[1]")),
    "generation_config temperature": ("generation_config.json", _gen_config(temperature="hot")),
    "generation_config do_sample": ("generation_config.json", _gen_config(do_sample="false")),
    "generation_config top_k": ("generation_config.json", _gen_config(top_k=2.5)),
    "generation_config eos_token_id": ("generation_config.json", _gen_config(eos_token_id="</s>")),
}


@pytest.mark.parametrize("case", SIDE_FILES)
def test_malformed_side_file_is_a_load_error_naming_it(ckpt, case):
    name, spoil = SIDE_FILES[case]
    spoil(ckpt)
    with pytest.raises(lily.ModelLoadError) as ei:
        lily.load(ckpt, backend="cpu", max_seq=64, progress=False)
    assert name in str(ei.value), ei.value


@pytest.mark.parametrize("name", ["tokenizer_config.json", "chat_template.jinja", "generation_config.json"])
def test_unreadable_side_file_is_a_load_error_naming_it(ckpt, name, monkeypatch):
    """(Simulated: file modes do not stop root, who runs CI.)"""
    read_text, read_bytes = pathlib.Path.read_text, pathlib.Path.read_bytes

    def refuse(method):
        def read(self, *args, **kwargs):
            if self.name == name:
                raise PermissionError(13, "Permission denied", str(self))
            return method(self, *args, **kwargs)

        return read

    monkeypatch.setattr(pathlib.Path, "read_text", refuse(read_text))
    monkeypatch.setattr(pathlib.Path, "read_bytes", refuse(read_bytes))
    with pytest.raises(lily.ModelLoadError, match=name.replace(".", r"\.") + ".*Permission denied"):
        lily.load(ckpt, backend="cpu", max_seq=64, progress=False)


# --------------------------------------------------------------------------------------------------
# arguments of the public functions: (call, exception, text the message must contain)

BAD_CALLS = {
    "max_tokens str": (lambda m: m.generate("hi", max_tokens="5"), TypeError, "max_tokens"),
    "max_tokens float": (lambda m: m.generate("hi", max_tokens=5.5), TypeError, "max_tokens"),
    "max_tokens bool": (lambda m: m.generate("hi", max_tokens=True), TypeError, "max_tokens"),
    "max_tokens negative": (lambda m: m.generate("hi", max_tokens=-1), ValueError, "max_tokens"),
    "stop int in list": (lambda m: m.generate("hi", stop=[5]), TypeError, "stop[0]"),
    "stop int": (lambda m: m.generate("hi", stop=5), TypeError, "stop"),
    "stop bytes": (lambda m: m.stream("hi", stop=b"x"), TypeError, "stop"),
    "stop surrogate": (lambda m: m.generate("hi", stop=["\ud800"]), ValueError, "stop[0]"),
    "logit_bias list": (lambda m: m.generate("hi", logit_bias=[1]), TypeError, "logit_bias"),
    "logit_bias str key": (lambda m: m.generate("hi", logit_bias={"a": 1}), TypeError, "logit_bias"),
    "logit_bias float key": (lambda m: m.generate("hi", logit_bias={1.5: 1}), TypeError, "logit_bias"),
    "logit_bias str value": (lambda m: m.generate("hi", logit_bias={1: "x"}), TypeError, "logit_bias[1]"),
    "logit_bias nan": (lambda m: m.generate("hi", logit_bias={1: float("nan")}), ValueError, "logit_bias"),
    "logit_bias past the vocabulary": (lambda m: m.generate("hi", logit_bias={10**6: 5.0}), ValueError, "logit_bias"),
    "temperature str": (lambda m: m.generate("hi", temperature="hot"), TypeError, "temperature"),
    "temperature list": (lambda m: m.generate("hi", temperature=[1]), TypeError, "temperature"),
    "top_k str": (lambda m: m.generate("hi", top_k="5"), TypeError, "top_k"),
    "top_k float": (lambda m: m.generate("hi", top_k=2.5), TypeError, "top_k"),
    "top_p str": (lambda m: m.generate("hi", top_p="x"), TypeError, "top_p"),
    "min_p list": (lambda m: m.generate("hi", min_p=[0.1]), TypeError, "min_p"),
    "repetition_penalty str": (lambda m: m.generate("hi", repetition_penalty="1"), TypeError, "repetition_penalty"),
    "seed str": (lambda m: m.generate("hi", seed="x"), TypeError, "seed"),
    "seed float": (lambda m: m.generate("hi", seed=1.5), TypeError, "seed"),
    "seed negative": (lambda m: m.generate("hi", seed=-1), ValueError, "seed"),
    "unknown option": (lambda m: m.generate("hi", temprature=0.5), TypeError, "temprature"),
    "sampler str": (lambda m: m.generate("hi", sampler="greedy"), TypeError, "sampler"),
    "logprobs str": (lambda m: m.generate("hi", logprobs="yes"), TypeError, "logprobs"),
    "verbose str": (lambda m: m.generate("hi", verbose="yes"), TypeError, "verbose"),
    "prompt int": (lambda m: m.generate(5), TypeError, "prompt"),
    "prompt None": (lambda m: m.stream(None), TypeError, "prompt"),
    "prompt bytes": (lambda m: m.generate(b"ab"), TypeError, "prompt"),
    "prompt float id": (lambda m: m.generate([1.5]), TypeError, "prompt[0]"),
    "prompt str id": (lambda m: m.generate(["a"]), TypeError, "prompt[0]"),
    "prompt huge id": (lambda m: m.generate([10**30]), ValueError, "prompt[0]"),
    "prompt negative id": (lambda m: m.generate([1, -1]), ValueError, "prompt[1]"),
    "prompt surrogate": (lambda m: m.generate("a\ud800b"), ValueError, "prompt"),
    "messages None": (lambda m: m.chat(None), TypeError, "messages"),
    "messages str": (lambda m: m.chat("hi"), TypeError, "messages"),
    "messages of ints": (lambda m: m.chat([5]), TypeError, "messages[0]"),
    "message surrogate": (lambda m: m.chat([{"role": "user", "content": "a\ud800"}]), ValueError,
                          "messages[0]['content']"),
    "nested surrogate": (lambda m: m.chat([{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]),
                         ValueError, "messages[0]['content'][0]['text']"),
    "tools str": (lambda m: m.chat(MESSAGES, tools="search"), TypeError, "tools"),
    "tools int": (lambda m: m.chat(MESSAGES, tools=5), TypeError, "tools"),
    "tool surrogate": (lambda m: m.chat(MESSAGES, tools=[{"type": "function", "function": {"name": "\ud800"}}]),
                       ValueError, "tools[0]"),
    "template_kwargs int": (lambda m: m.chat(MESSAGES, template_kwargs=5), TypeError, "template_kwargs"),
    "template_kwargs int key": (lambda m: m.chat(MESSAGES, template_kwargs={1: 2}), TypeError, "template_kwargs"),
    # template_kwargs that are apply_chat_template's own arguments: tokenize=True made the prompt a list of ids
    # (an AssertionError); image parts rendered a placeholder for a picture the text model never sees; a str part
    # containing "text" rendered as nothing
    "template_kwargs tokenize": (lambda m: m.chat(MESSAGES, template_kwargs={"tokenize": True}), TypeError,
                                 "tokenize"),
    "image part": (lambda m: m.chat([{"role": "user", "content": [{"type": "image", "image": "cat.png"}]}]),
                   ValueError, "messages[0]['content'][0]"),
    "image_url part": (lambda m: m.chat([{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]}]),
                       ValueError, "messages[0]['content'][1]"),
    "video part": (lambda m: m.chat([{"role": "user", "content": [{"type": "video", "video": "x"}]}]), ValueError,
                   "messages[0]['content'][0]"),
    "str part": (lambda m: m.chat([{"role": "user", "content": ["some text"]}]), TypeError,
                 "messages[0]['content'][0]"),
    "enable_thinking str": (lambda m: m.chat(MESSAGES, enable_thinking="no"), TypeError, "enable_thinking"),
    "stream str": (lambda m: m.chat(MESSAGES, stream="yes"), TypeError, "stream"),
    "tool call arguments not JSON": (lambda m: m.chat([
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
        {"role": "user", "content": "y"}]), lily.TemplateError, "chat template"),
    # nested past Python's recursion limit: a bare RecursionError
    "message nested 3000 deep": (lambda m: m.chat([{"role": "user", "content": "x", "extra": _nested(3000)}]),
                                 lily.TemplateError, "nest too deeply"),
    "tool call arguments nested 5000 deep": (lambda m: m.chat([
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "[" * 5000}}]},
        {"role": "user", "content": "y"}]), lily.TemplateError, "chat template"),
    "tokenize str": (lambda m: m.apply_chat_template(MESSAGES, tokenize="yes"), TypeError, "tokenize"),
    "encode int": (lambda m: m.tokenizer.encode(5), TypeError, "text"),
    "encode surrogate": (lambda m: m.tokenizer.encode("\ud800"), ValueError, "text"),
    "decode str id": (lambda m: m.tokenizer.decode(["a"]), TypeError, "ids[0]"),
    "decode None": (lambda m: m.tokenizer.decode(None), TypeError, "ids"),
    "decode out of range": (lambda m: m.tokenizer.decode([10**6]), ValueError, "ids[0]"),
    "detokenizer str": (lambda m: m.tokenizer.detokenizer().add("a"), TypeError, "token"),
    "detokenizer float": (lambda m: m.tokenizer.detokenizer().add(1.5), TypeError, "token"),
    "token_bytes str": (lambda m: m.tokenizer.token_bytes("a"), TypeError, "token_id"),
    "Sampler top_k None": (lambda m: lily.Sampler(top_k=None), TypeError, "top_k"),
    "Sampler vocab_limit str": (lambda m: lily.Sampler(vocab_limit="x"), TypeError, "vocab_limit"),
    "Sampler vocab_limit 0": (lambda m: lily.Sampler(vocab_limit=0), ValueError, "vocab_limit"),
    "Sampler logits str": (lambda m: lily.Sampler().sample(["a"]), TypeError, "logits"),
    "Sampler reset str": (lambda m: lily.Sampler().reset(["a"]), TypeError, "prompt[0]"),
    "Sampler accept negative": (lambda m: lily.Sampler().accept(-1), ValueError, "token"),
    "Sampler top_logprobs negative": (lambda m: lily.Sampler().top_logprobs(np.zeros(4, np.float32), -1), ValueError,
                                      "k"),
    "Sampler top_logprobs float": (lambda m: lily.Sampler().top_logprobs(np.zeros(4, np.float32), 2.0), TypeError,
                                   "k"),
    "load int": (lambda m: lily.load(5), TypeError, "model"),
    "load max_seq str": (lambda m: lily.load("/nowhere", max_seq="5"), TypeError, "max_seq"),
    "load max_seq 0": (lambda m: lily.load("/nowhere", max_seq=0), ValueError, "max_seq"),
    "load prefill_chunk float": (lambda m: lily.load("/nowhere", prefill_chunk=1.5), TypeError, "prefill_chunk"),
    "load revision int": (lambda m: lily.load("org/name", revision=5), TypeError, "revision"),
    "load progress str": (lambda m: lily.load("/nowhere", progress="no"), TypeError, "progress"),
    "split_reasoning int": (lambda m: lily.split_reasoning(5), TypeError, "text"),
    "ChatTemplate int": (lambda m: lily.ChatTemplate(5), TypeError, "source"),
    "ChatTemplate syntax": (lambda m: lily.ChatTemplate("{% if %}"), lily.TemplateError, "Jinja"),
    "Completion.from_dict int": (lambda m: lily.Completion.from_dict(5), TypeError, "data"),
    "Completion.from_dict empty": (lambda m: lily.Completion.from_dict({}), ValueError, "text"),
    "AssistantMessage.from_dict list": (lambda m: lily.AssistantMessage.from_dict([]), TypeError, "data"),
    "Engine prefill huge id": (lambda m: m.engine.prefill([2**64]), ValueError, "tokens"),
    "Engine decode huge id": (lambda m: m.engine.decode(-(2**70)), ValueError, "token"),
    "Engine prefill float": (lambda m: m.engine.prefill([1.5]), TypeError, "tokens"),
    "Engine cached_prefix str": (lambda m: m.engine.cached_prefix(["a"]), TypeError, "tokens"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_argument_is_a_typed_error_naming_it(model, case):
    call, kind, named = BAD_CALLS[case]
    position = model.engine.position
    with pytest.raises(kind) as ei:
        result = call(model)
        if hasattr(result, "__next__"):  # a stream checks its arguments when it is made, not when iterated
            pytest.fail("the error came only when iterating")
    assert named in str(ei.value), ei.value
    assert model.engine.position == position  # nothing ran


def test_good_argument_types_still_work(model):
    """What the checks must let through: NumPy integers and floats, tuples, a generator of messages."""
    ids = np.array([5, 6, 7], dtype=np.int64)
    a = model.generate(ids, max_tokens=np.int32(3), temperature=np.float32(0), top_k=np.int64(5),
                       logit_bias={np.int64(5): 1}, stop=("zz",), seed=np.uint64(2), logprobs=np.bool_(True))
    b = model.generate((5, 6, 7), max_tokens=3, temperature=0, top_k=5, logit_bias={5: 1.0}, stop="zz", seed=2,
                       logprobs=True)
    assert a.tokens == b.tokens and len(a.logprobs) == len(a.tokens)
    msg = model.chat(iter(MESSAGES), max_tokens=2, temperature=0)
    assert msg.finish_reason in ("stop", "length")
    assert model.engine.cached_prefix([2**80]) == 0
