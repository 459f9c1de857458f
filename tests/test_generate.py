"""Generation loop, stop conditions, UTF-8 streaming, chat parsing and tool calls.

Most tests drive ``Model`` with a fake engine that returns scripted logits (the real tokenizer, the
real vocabulary size); the last ones run ``lily.load`` -> ``chat`` on a tiny random checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import pickle

import fixtures
import lily
import numpy as np
import pytest
from lily.model import Model
from lily.reasoning import split_reasoning
from lily.template import ChatTemplate
from lily.tokenizer import Tokenizer
from lily.tools import parse_tool_calls

QWEN = fixtures.qwen_tokenizer_dir()
VOCAB = 248_320
IM_END, ENDOFTEXT = 248_046, 248_044
GEN_CONFIG = json.loads((QWEN / "generation_config.json").read_text())


class FakeEngine:
    """Engine stand-in: the logits after the n-th generated position of a sequence make ``script[n]`` the argmax
    (and leave some mass elsewhere so that sampling with top-k keeps it likely but not certain). Sequences as
    the real engine has them (``new_sequence``, ``fork``, ``decode_batch``, ...); each runs the script from its
    own position in it. The attributes ``position``, ``cached``, ``step`` are the default sequence's."""

    _STATE = ("position", "cached", "step", "last_prefill")

    def __init__(self, script, vocab=VOCAB, max_seq=1 << 20, pad_trap=True, prefill_chunk=512):
        self.script = list(script)
        self.vocab, self.max_seq, self.prefill_chunk = vocab, max_seq, prefill_chunk
        self.vocab_size = vocab
        self.pad_trap = pad_trap
        self.position, self.step = 0, 0
        self.prefilled: list[list[int]] = []
        self.decoded: list[int] = []
        self.resets = 0
        self.backend, self.config = "fake", {}
        self.cached: list[int] = []  # the token behind each KV row (as the real engine tracks it)
        self.last_prefill = False  # whether the last call was a prefill (whose logits may go unsampled)
        self.others: dict[int, dict] = {}  # sequences other than 0: their state
        self._next_seq = 1

    @contextlib.contextmanager
    def _on(self, seq):
        """The attributes hold sequence ``seq``'s state while inside."""
        if seq == 0:
            yield
            return
        saved = {k: getattr(self, k) for k in self._STATE}
        for k, v in self.others[seq].items():
            setattr(self, k, v)
        try:
            yield
        finally:
            self.others[seq] = {k: getattr(self, k) for k in self._STATE}
            for k, v in saved.items():
                setattr(self, k, v)

    def _state(self, seq):
        with self._on(seq):
            return {"position": self.position, "cached": list(self.cached), "step": self.step, "last_prefill": False}

    def _logits(self):
        row = np.full(self.vocab, -30.0, dtype=np.float32)
        if self.pad_trap:
            row[248_077:] = 1e4  # padding rows: must never be sampled
        token = self.script[self.step] if self.step < len(self.script) else 0
        row[token] = 30.0
        self.step += 1
        return row

    def prefill(self, tokens, *, all_logits=False, seq=0):
        with self._on(seq):
            if self.position + len(tokens) > self.max_seq:
                raise lily.ContextFullError("full")
            if self.last_prefill:  # a prompt prefilled in pieces: only the last piece's logits are sampled
                self.step -= 1
            self.last_prefill = True
            self.prefilled.append(list(tokens))
            self.cached = self.cached[: self.position] + list(tokens)
            self.position += len(tokens)
            return self._logits()

    def decode(self, token, *, seq=0):
        with self._on(seq):
            if self.position + 1 > self.max_seq:
                raise lily.ContextFullError("full")
            self.last_prefill = False
            self.decoded.append(token)
            self.cached = self.cached[: self.position] + [token]
            self.position += 1
            return self._logits()

    def decode_batch(self, batch):
        assert len({s for s, _ in batch}) == len(batch) <= self.prefill_chunk
        return np.stack([self.decode(token, seq=seq) for seq, token in batch])

    def reset(self, seq=0):
        with self._on(seq):
            self.position, self.step = 0, 0  # the script starts over with a new sequence
            self.last_prefill = False
            self.resets += 1

    def new_sequence(self):
        n, self._next_seq = self._next_seq, self._next_seq + 1
        self.others[n] = {"position": 0, "cached": [], "step": 0, "last_prefill": False}
        return n

    def fork(self, seq=0):
        n = self.new_sequence()
        self.others[n] = self._state(seq)
        return n

    def copy_sequence(self, src, dst):
        state = self._state(src)
        with self._on(dst):
            for k, v in state.items():
                setattr(self, k, v)

    def drop_sequence(self, seq):
        del self.others[seq]

    @property
    def sequences(self):
        return [0, *self.others]

    def sequence_bytes(self, seq):
        return 1 + self._state(seq)["position"]

    def sequences_bytes(self, seqs):
        return sum(self.sequence_bytes(s) for s in set(seqs))

    def cached_prefix(self, tokens, seq=0):
        with self._on(seq):
            n = 0
            while n < min(len(tokens), len(self.cached)) and tokens[n] == self.cached[n]:
                n += 1
            return n

    def snapshot(self):
        return FakeSnapshot(self.position, self.cached[: self.position], self.step)

    def restore(self, snap):
        if self.cached[: snap.position] != snap.tokens:
            raise ValueError("snapshot does not match this engine's cache")
        self.position = snap.position


class FakeSnapshot:
    def __init__(self, position, tokens, step):
        self.position, self.tokens, self.step = position, tokens, step


@pytest.fixture(scope="module")
def tok():
    t = Tokenizer.from_file(QWEN / "tokenizer.json", eos_ids=[IM_END, ENDOFTEXT])
    t.detokenizer()
    return t


def make(tok, text_or_ids, *, eos=True, **kw):
    ids = tok.encode(text_or_ids) if isinstance(text_or_ids, str) else list(text_or_ids)
    engine = FakeEngine(ids + ([IM_END] if eos else []), **kw)
    return Model(engine, tok, ChatTemplate.from_dir(QWEN), GEN_CONFIG, QWEN), engine


def test_generate_stops_on_eos_with_stats(tok):
    model, engine = make(tok, "Hello there, 世界 🎉!")
    out = model.generate("Say hi", temperature=0)
    assert out == "Hello there, 世界 🎉!" and out.finish_reason == "stop"
    assert out.tokens[-1] == IM_END and out.tokens[:-1] == tok.encode("Hello there, 世界 🎉!")
    s = out.stats
    assert s.prompt_tokens == len(tok.encode("Say hi")) and s.generated_tokens == len(out.tokens)
    assert s.prompt_tps > 0 and s.decode_tps > 0 and s.time_to_first_token_s > 0
    assert "tok/s" in str(s)
    assert engine.decoded == out.tokens[:-1]  # eos is never fed back


def test_default_sampling_is_generation_config_and_never_pads(tok):
    model, _ = make(tok, "abc def ghi")
    s = model.sampler()
    assert (s.temperature, s.top_k, s.top_p, s.vocab_limit) == (1.0, 20, 0.95, 248_077)
    assert model.generate("x", seed=0) == "abc def ghi"  # the scripted token dominates; padding never wins


def test_max_tokens_gives_length(tok):
    model, _ = make(tok, "one two three four five six")
    out = model.generate("x", max_tokens=3, temperature=0)
    assert out.finish_reason == "length" and len(out.tokens) == 3
    assert out == tok.decode(tok.encode("one two three four five six")[:3])


def test_context_full_gives_length(tok):
    model, engine = make(tok, "one two three four five six", max_seq=6)
    out = model.generate("x y", temperature=0)
    assert out.finish_reason == "length" and engine.position == 6


def test_stream_chunks_are_whole_characters(tok):
    # every byte of the emoji and CJK text as its own byte-level token
    byte_token = {tok.token_bytes(i): i for i in range(248_044) if len(tok.token_bytes(i)) == 1}
    text = "a🎉b中文é"
    ids = [byte_token[bytes([b])] for b in text.encode()]
    model, _ = make(tok, ids)
    chunks = list(model.stream("x", temperature=0, logprobs=True))
    assert "".join(c.text for c in chunks) == text
    assert all("\ufffd" not in c.text for c in chunks)
    assert [c.token for c in chunks] == ids + [IM_END]
    assert all(c.logprob is not None and c.logprob <= 0 for c in chunks)
    assert [c.finish_reason for c in chunks] == [None] * len(ids) + ["stop"]
    assert sum(1 for c in chunks if c.text) == len(text)  # one chunk per completed character


@pytest.mark.parametrize(
    "stop, want",
    [
        ("world", "Hello "),  # inside one token
        ("o wo", "Hell"),  # spans tokens
        (["zzz", "lo w"], "Hel"),  # earliest of several
        ("\n\nEND", "Hello world, this is"),  # spans three tokens
    ],
)
def test_stop_strings_across_tokens(tok, stop, want):
    model, _ = make(tok, "Hello world, this is\n\nEND of it")
    out = model.generate("x", temperature=0, stop=stop)
    assert out == want and out.finish_reason == "stop"
    streamed = "".join(c.text for c in model.stream("x", temperature=0, stop=stop))
    assert streamed == want


def test_held_back_prefix_is_released(tok):
    model, _ = make(tok, "Hello wo")
    out = model.generate("x", temperature=0, stop="world")
    assert out == "Hello wo" and out.finish_reason == "stop"  # stopped by eos, not by the partial match
    model, _ = make(tok, "Hello wo", eos=False)
    out = model.generate("x", temperature=0, stop="world", max_tokens=2)
    assert out == "Hello wo" and out.finish_reason == "length"


def test_same_seed_same_text(tok):
    model, _ = make(tok, "a b c d e f g h")
    rows = []
    for _ in range(2):
        model.engine.step = 0
        rows.append(model.generate("x", temperature=5.0, top_k=0, top_p=1.0, seed=11, max_tokens=8).tokens)
    assert rows[0] == rows[1]


def test_prefix_reuse_and_reset(tok):
    model, engine = make(tok, "fine")
    model.generate("abc", temperature=0)
    first = engine.prefilled[-1]
    engine.step = 0
    longer = first + [engine.decoded[0]] + tok.encode(" more")
    model.generate(longer, temperature=0)
    assert engine.prefilled[-1] == tok.encode(" more") or engine.prefilled[-1] == longer[len(first) + 1 :]
    resets = engine.resets
    engine.step = 0
    model.generate("different", temperature=0)
    assert engine.resets == resets + 1 and engine.prefilled[-1] == tok.encode("different")


def test_chat_splits_reasoning_and_content(tok):
    model, _ = make(tok, "The user greets me.\n</think>\n\nHello! How can I help?")
    msg = model.chat([{"role": "user", "content": "Hi"}], temperature=0)
    assert msg["role"] == "assistant" and msg.content == "Hello! How can I help?"
    assert msg.reasoning_content == "The user greets me." and msg.tool_calls == []
    assert msg.finish_reason == "stop" and msg.stats.generated_tokens > 0
    # thinking off: the output is all content
    model, _ = make(tok, "Plain answer.")
    msg = model.chat([{"role": "user", "content": "Hi"}], enable_thinking=False, temperature=0)
    assert msg.content == "Plain answer." and msg.reasoning_content is None


def test_chat_stream_routes_deltas(tok):
    model, _ = make(tok, "think 中文 hard\n</think>\n\nAnswer: 42")
    chunks = list(model.chat([{"role": "user", "content": "Q"}], stream=True, temperature=0))
    reasoning = "".join(c.reasoning for c in chunks)
    content = "".join(c.content for c in chunks)
    assert reasoning.strip() == "think 中文 hard" and content == "Answer: 42"
    assert chunks[-1].finish_reason == "stop" and chunks[-1].message.content == "Answer: 42"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "opts": {"type": "object"},
                },
            },
        },
    }
]
CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
    '<parameter=opts>\n{"a": [1, 2]}\n</parameter>\n</function>\n</tool_call>'
)


def test_chat_parses_tool_calls_and_round_trips(tok):
    model, _ = make(tok, "Need weather.\n</think>\n\nLet me check.\n\n" + CALL)
    messages = [{"role": "user", "content": "Weather in São Paulo?"}]
    msg = model.chat(messages, tools=TOOLS, temperature=0)
    assert msg.content == "Let me check." and msg.reasoning_content == "Need weather."
    (call,) = msg.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    args = {"city": "São Paulo", "days": 3, "metric": True, "opts": {"a": [1, 2]}}
    assert json.loads(call["function"]["arguments"]) == args
    # the message goes back into the conversation as is (arguments as a JSON string)
    history = messages + [msg, {"role": "tool", "content": "sunny"}]
    model.engine.step = 0
    rendered_call = {**msg, "tool_calls": [{"function": {"name": "get_weather", "arguments": args}}]}
    text = model.apply_chat_template([*messages, rendered_call, history[-1]], tools=TOOLS)
    assert CALL in text
    model.chat(history, tools=TOOLS, temperature=0)  # does not raise


def test_results_keep_their_data_when_serialized(tok):
    """pickle keeps everything; ``json.dumps`` of the plain value (text, chat message) drops the extras, so
    ``to_dict`` / ``from_dict`` carry them through JSON."""
    model, _ = make(tok, "Need weather.\n</think>\n\nLet me check.\n\n" + CALL)
    msg = model.chat([{"role": "user", "content": "Weather?"}], tools=TOOLS, temperature=0, logprobs=True)
    model, _ = make(tok, "Hello there")
    out = model.generate("Say hi", temperature=0, logprobs=True)
    assert out.logprobs and msg.tool_calls and msg.stats.generated_tokens > 0
    for value in (out, msg):
        via_json = type(value).from_dict(json.loads(json.dumps(value.to_dict())))
        for copy in (pickle.loads(pickle.dumps(value)), via_json):
            assert type(copy) is type(value) and copy == value
            assert copy.finish_reason == value.finish_reason == "stop"
            assert copy.stats == value.stats and str(copy.stats) == str(value.stats)
    for copy in (pickle.loads(pickle.dumps(out)), lily.Completion.from_dict(json.loads(json.dumps(out.to_dict())))):
        assert (copy.text, copy.tokens, copy.logprobs) == (out.text, out.tokens, out.logprobs)
    assert json.loads(json.dumps(out)) == out.text  # a str to json
    assert json.loads(json.dumps(msg)) == dict(msg)  # the chat message, ready for the next turn
    msg["name"] = "weather-bot"  # keys the caller adds survive too
    assert pickle.loads(pickle.dumps(msg))["name"] == lily.AssistantMessage.from_dict(msg.to_dict())["name"]


def test_parse_tool_calls_well_formed_and_malformed():
    content, calls = parse_tool_calls("x\n" + CALL + "\n" + CALL.replace("get_weather", "other"), TOOLS)
    assert content == "x" and [c["function"]["name"] for c in calls] == ["get_weather", "other"]
    assert json.loads(calls[1]["function"]["arguments"])["days"] == "3"  # no schema: strings
    multiline = (
        "<tool_call>\n<function=f>\n<parameter=code>\ndef f():\n    return 1\n</parameter>\n</function>\n</tool_call>"
    )
    assert json.loads(parse_tool_calls(multiline)[1][0]["function"]["arguments"]) == {"code": "def f():\n    return 1"}
    no_args = parse_tool_calls("<tool_call>\n<function=f>\n</function>\n</tool_call>")[1][0]
    assert no_args["function"]["arguments"] == "{}"
    for bad in [
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n",  # unclosed (cut off)
        "<tool_call>\nnot xml at all\n</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>",  # unclosed parameter
        "<tool_call>\n<function=>\n</function>\n</tool_call>",  # no name
        "<tool_call>\n<function=f>\nstray<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>",  # JSON style: not this model's format
        "</tool_call><tool_call>",
    ]:
        content, calls = parse_tool_calls("before " + bad, TOOLS)
        assert calls == [] and content == "before " + bad
    # bad typed values stay strings instead of raising
    bad_int = CALL.replace("\n3\n", "\nthree\n").replace('{"a": [1, 2]}', "{oops")
    args = json.loads(parse_tool_calls(bad_int, TOOLS)[1][0]["function"]["arguments"])
    assert args["days"] == "three" and args["opts"] == "{oops"
    # one good and one malformed call: the good one is parsed, the bad one stays in the content
    content, calls = parse_tool_calls(CALL + "\n<tool_call>\nbroken\n</tool_call>", TOOLS)
    assert len(calls) == 1 and content == "<tool_call>\nbroken\n</tool_call>"


def test_chat_with_malformed_call_returns_content(tok):
    model, _ = make(tok, "ok\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis")
    msg = model.chat([{"role": "user", "content": "Q"}], tools=TOOLS, temperature=0)
    assert msg.tool_calls == [] and msg.content.startswith("<tool_call>")


def test_split_reasoning():
    assert split_reasoning("a\n</think>\n\nb") == ("a", "b")
    assert split_reasoning("<think>\na\n</think>b") == ("a", "b")
    assert split_reasoning("still thinking") == ("still thinking", "")
    assert split_reasoning("plain", thinking=False) == (None, "plain")


def test_bad_arguments(tok):
    model, _ = make(tok, "x")
    with pytest.raises(TypeError):
        model.generate("x", temprature=0.5)
    with pytest.raises(ValueError):
        model.generate("", temperature=0)
    with pytest.raises(ValueError):
        model.generate("x", top_p=2.0)
    with pytest.raises(ValueError):
        lily.load("x", backend="tpu")
    with pytest.raises(lily.ModelLoadError, match="no such folder"):
        lily.load("/nonexistent/model")


# ---- end to end on a tiny random checkpoint that carries the real tokenizer


@pytest.fixture(scope="module")
def tiny_real(tmp_path_factory):
    import fixtures

    folder = tmp_path_factory.mktemp("tiny-real") / "ckpt"
    fixtures.write_hf_checkpoint(folder, preset="tiny", seed=0, real_tokenizer=True)
    return lily.load(folder, backend="cpu", max_seq=512)


def test_end_to_end_chat(tiny_real):
    model = tiny_real
    assert len(model.tokenizer) == 248_077 and model.engine.config
    messages = [{"role": "user", "content": "Hello! 你好"}]
    a = model.chat(messages, max_tokens=12, seed=3)
    b = model.chat(messages, max_tokens=12, seed=3)
    assert a == b and a.finish_reason in ("stop", "length")
    assert a.stats.prompt_tokens == len(model.apply_chat_template(messages, tokenize=True))
    assert a.stats.generated_tokens <= 12 and a.stats.decode_tps >= 0
    chunks = list(model.chat(messages, stream=True, max_tokens=6, temperature=0))
    assert chunks[-1].message is not None
    c = model.generate("The capital of France is", max_tokens=5, temperature=0, logprobs=True)
    assert len(c.tokens) <= 5 and all(t < 248_077 for t in c.tokens) and len(c.logprobs) == len(c.tokens)
    # a second turn extending the first reuses the engine state
    history = messages + [a, {"role": "user", "content": "again"}]
    model.chat(history, max_tokens=4, seed=1, template_kwargs={"preserve_thinking": True})


def test_next_chat_turn_reuses_the_prefix_and_matches_a_fresh_run(tiny_real):
    model = tiny_real
    model.reset()
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    first = model.chat(turn1, max_tokens=6, temperature=0)
    turn2 = turn1 + [first, {"role": "user", "content": "And another one?"}]
    second = model.chat(turn2, max_tokens=6, temperature=0)
    # Everything up to the start of the last assistant message was reused, not recomputed.
    ids = model.apply_chat_template(turn2, tokenize=True)
    assert 0 < second.stats.cached_prompt_tokens < len(ids)
    model.reset()
    fresh = model.chat(turn2, max_tokens=6, temperature=0)
    assert fresh.stats.cached_prompt_tokens == 0
    assert fresh.content == second.content and fresh.reasoning_content == second.reasoning_content


def test_verbose_streams_like_mlx_lm(tok, capsys):
    model, _ = make(tok, "Hello there")
    out = model.generate("Say hi", temperature=0, verbose=True)
    printed = capsys.readouterr().out
    s = out.stats
    assert printed == (f"==========\nHello there\n==========\nPrompt: {s.prompt_tokens} tokens, {s.prompt_tps:.3f} "
                       f"tokens-per-sec\nGeneration: {s.generated_tokens} tokens, {s.decode_tps:.3f} tokens-per-sec\n")
    model, _ = make(tok, "Hmm.\n</think>\n\nHi!")
    msg = model.chat([{"role": "user", "content": "Hi"}], temperature=0, verbose=True)
    assert msg.content == "Hi!" and "Hmm.\n</think>\n\nHi!\n==========\nPrompt:" in capsys.readouterr().out
