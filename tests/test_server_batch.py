"""``lily serve``'s scheduler over loopback: concurrent requests run as one batch (each produces exactly what
it produces alone), a request joins streams already running, a client that leaves during a long prefill
frees its sequence between two prefill chunks, a full queue answers 429, and a conversation resumes its own
cached prefix after another conversation ran in between; grammars, stop strings and tool calls stay per request
in a batch. The evidence is the engine's own calls, recorded by a wrapper around it, not timing."""

from __future__ import annotations

import http.client
import json
import threading
import time

import fixtures
import lily
import pytest
from lily.server.app import Limits
from server_helpers import SlowEngine, model_for, raw_socket, running, tokenizer
from server_helpers import http as request
from test_server_limits import request_bytes


class Recorder:
    """The engine, with its scheduler-facing calls logged in order: ("prefill", seq, tokens), ("decode", seqs),
    ("drop", seq). ``hold(event)``, when set, is called with each prefill and decode event before it runs."""

    def __init__(self, engine):
        self.engine = engine
        self.log: list[tuple] = []
        self.hold = None

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _event(self, event):
        if self.hold is not None:
            self.hold(event)
        self.log.append(event)

    def prefill(self, tokens, **kw):
        self._event(("prefill", kw.get("seq", 0), len(tokens)))
        return self.engine.prefill(tokens, **kw)

    def decode(self, token, *, seq=0):
        self._event(("decode", [seq]))
        return self.engine.decode(token, seq=seq)

    def decode_batch(self, batch):
        self._event(("decode", [seq for seq, _ in batch]))
        return self.engine.decode_batch(batch)

    def drop_sequence(self, seq):
        self.log.append(("drop", seq))
        return self.engine.drop_sequence(seq)

    @property
    def batches(self):
        return [e[1] for e in self.log if e[0] == "decode"]


def wait_for(condition, what: str, seconds: float = 60.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("batch") / "ckpt"
    fixtures.write_hf_checkpoint(folder, preset="tiny", seed=0, real_tokenizer=True)
    return folder


def load(folder, **kw):
    model = lily.load(folder, backend="cpu", max_seq=2048, progress=False, **kw)
    model.engine = Recorder(model.engine)
    return model


class Stream(threading.Thread):
    """A streaming completion read event by event; ``first`` is set at its first token."""

    def __init__(self, server, prompt: str, max_tokens: int):
        super().__init__(daemon=True)
        self.server, self.prompt, self.max_tokens = server, prompt, max_tokens
        self.first = threading.Event()
        self.text, self.usage, self.error = "", None, None

    def run(self):
        try:
            conn = http.client.HTTPConnection(self.server.host, self.server.port, timeout=120)
            body = {"prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200, resp.read()
            for line in resp:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if event.get("usage"):
                    self.usage = event["usage"]
                for choice in event["choices"]:
                    self.text += choice["text"]
                    self.first.set()
            conn.close()
        except BaseException as e:  # reported by the test
            self.error = e
            self.first.set()

    def result(self):
        self.join(120)
        assert not self.is_alive() and self.error is None, self.error
        return self.text, self.usage["completion_tokens"]


PROMPTS = ["The capital of France is", "Once upon a time, in a small village", "def fibonacci(n):",
           "Lily is an inference engine that"]


def alone(folder, prompts, max_tokens):
    """Each prompt's greedy output, one request at a time on a fresh server (no prefix cache)."""
    with running(load(folder, prefix_cache_bytes=0), max_sequences=1) as server:
        out = []
        for p in prompts:
            s = Stream(server, p, max_tokens)
            s.start()
            out.append(s.result())
        return out


def test_concurrent_streams_produce_what_each_produces_alone_and_one_joins_midway(tiny):
    want = alone(tiny, PROMPTS, 24)
    model = load(tiny, prefix_cache_bytes=0)
    engine = model.engine
    with running(model, max_sequences=4) as server:
        worker = server.worker

        def hold(event):
            if event[0] == "prefill":  # the first prefill waits until three requests are in
                wait_for(lambda: len(worker.running) + len(worker.waiting) >= 3, "three requests")
            elif len(event[1]) == 3:  # the three decode together: the fourth comes in before the next step
                engine.hold = None
                joined.set()
                wait_for(lambda: len(worker.running) + len(worker.waiting) >= 4, "the fourth request")

        joined = threading.Event()
        engine.hold = hold
        streams = [Stream(server, p, 24) for p in PROMPTS]
        for s in streams[:3]:
            s.start()
        assert joined.wait(60)
        streams[3].start()
        got = [s.result() for s in streams]
    assert got == want
    batches = engine.batches
    first = next(i for i, b in enumerate(batches) if len(b) == 3)
    three = set(batches[first])
    (fourth,) = {seq for b in batches for seq in b} - three
    assert any(fourth in b and set(b) & three for b in batches[first + 1:]), \
        "the late request never decoded in the same step as the running ones"
    assert sorted(e[1] for e in engine.log if e[0] == "drop") == sorted(three | {fourth})


def test_a_client_leaving_during_a_long_prefill_frees_its_sequence_between_chunks(tiny):
    (want,) = alone(tiny, PROMPTS[:1], 48)
    model = load(tiny, prefix_cache_bytes=0)
    engine = model.engine
    long_prompt = " ".join(f"word{i}" for i in range(400))
    n_long = len(tokenizer().encode(long_prompt))
    with running(model, max_sequences=2, max_batch_tokens=32) as server:
        worker = server.worker
        other_seq: list[int] = []
        long_chunks: list[int] = []
        started, left = threading.Event(), threading.Event()

        def hold(event):
            if event[0] == "decode" and not other_seq:  # the other stream decodes: wait for the long request
                other_seq.extend(event[1])
                wait_for(lambda: len(worker.running) + len(worker.waiting) >= 2, "the long request")
            elif event[0] == "prefill" and other_seq:
                long_chunks.append(event[1])
                if len(long_chunks) == 2:  # its second chunk: the client leaves now
                    started.set()
                    assert left.wait(60)

        engine.hold = hold
        other = Stream(server, PROMPTS[0], 48)
        other.start()
        wait_for(lambda: other_seq, "the other stream's first decode step")
        sock = raw_socket(server)
        sock.sendall(request_bytes("/v1/completions", {"prompt": long_prompt, "max_tokens": 4, "stream": True}))
        assert started.wait(60)
        sock.close()
        wait_for(lambda: any(j.cancel_reason == "client disconnected" for j in worker.running), "the disconnect")
        left.set()
        assert other.result() == want  # the other stream went on, unchanged
        (long_seq,) = set(long_chunks)
        wait_for(lambda: ("drop", long_seq) in engine.log, "the long request's sequence to be dropped")
    log = engine.log
    dropped_at = log.index(("drop", long_seq))
    prefilled = sum(e[2] for e in log if e[0] == "prefill" and e[1] == long_seq)
    assert prefilled == 64 < n_long, f"{prefilled} of the {n_long} prompt tokens were prefilled"
    assert long_seq not in engine.sequences
    assert not any(e[0] == "decode" and long_seq in e[1] for e in log), "the cancelled request decoded"
    assert any(e[0] == "decode" and other_seq[0] in e[1] for e in log[dropped_at:]), \
        "the other stream did not go on after the long request left"


def test_a_short_prompt_gets_its_first_token_while_a_long_prefill_goes_on(tiny):
    """A short request that arrives during a long prefill is prefilled first and decodes (here: finishes) while
    the long prompt is still being prefilled, 32 tokens a step; the long one then completes."""
    (want,) = alone(tiny, PROMPTS[:1], 4)
    model = load(tiny, prefix_cache_bytes=0)
    engine = model.engine
    long_prompt = " ".join(f"word{i}" for i in range(400))
    with running(model, max_sequences=2, max_batch_tokens=32) as server:
        worker = server.worker
        long_seq: list[int] = []

        def hold(event):  # the long prompt's first chunk waits until the short request is in
            long_seq.append(event[1])
            engine.hold = None
            wait_for(lambda: len(worker.running) + len(worker.waiting) >= 2, "the short request")

        engine.hold = hold
        long = Stream(server, long_prompt, 2)
        long.start()
        wait_for(lambda: long_seq, "the long prompt's first chunk")
        short = Stream(server, PROMPTS[0], 4)
        short.start()
        assert short.result() == want
        long.result()
    log = engine.log
    (short_seq,) = {e[1] for e in log if e[0] == "prefill"} - set(long_seq)
    long_chunks = [i for i, e in enumerate(log) if e[0] == "prefill" and e[1] == long_seq[0]]
    short_prefill = [i for i, e in enumerate(log) if e[0] == "prefill" and e[1] == short_seq]
    short_decodes = [i for i, e in enumerate(log) if e[0] == "decode" and short_seq in e[1]]
    assert len(long_chunks) > 30 and max(log[i][2] for i in long_chunks) <= 32
    assert long_chunks[0] < short_prefill[0] and short_decodes, (long_chunks[:3], short_prefill, short_decodes)
    # Under first come, first served the short prompt would wait for all of the long one's chunks.
    assert log.index(("drop", short_seq)) < long_chunks[-1], "the short request waited for the long prefill"


def test_prefill_plan_serves_short_prompts_first_and_never_starves_a_long_one():
    """A 1,000-token prompt, and a new 32-token prompt every step that alone would fill the step's budget:
    the short ones go first, yet the long one gains priority as it waits and ends its prefill within about
    twice the steps it needs alone."""
    from types import SimpleNamespace

    from lily.server.worker import prefill_plan

    budget, n = 32, 1000
    long = SimpleNamespace(arrived=0, done=0, ids=[0] * n)
    jobs = [long]
    for step in range(1, 10 * n // budget):
        jobs.append(SimpleNamespace(arrived=step, done=0, ids=[0] * budget))
        plan = prefill_plan([j for j in jobs if j.done < len(j.ids)], budget)
        assert sum(k for _, k in plan) == budget
        for r, k in plan:
            r.done += k
        if step == 1:
            assert long.done == 0 and jobs[1].done == budget  # the short one first
        if long.done == n:
            break
    assert long.done == n and step <= 2 * n // budget + 2, (long.done, step)
    # Within a step the budget goes on to the next job: two short prompts share one.
    a, b = (SimpleNamespace(arrived=0, done=0, ids=[0] * k) for k in (10, 30))
    assert [(r, k) for r, k in prefill_plan([b, a], budget)] == [(a, 10), (b, 22)]


def test_a_full_queue_answers_429_in_each_apis_shape():
    engine = SlowEngine(tokenizer().encode("a")[0], delay=0.01)
    with running(model_for(engine, prefix_cache_bytes=0), max_sequences=1, max_waiting=1) as server:
        # One generating, then one waiting: the second is sent once the first runs (sent together, the
        # second could find the first still in the one waiting place and be refused itself).
        socks = [generating(server)]
        socks.append(queued(server, "/v1/completions", FOREVER)[0])
        assert (len(server.worker.running), len(server.worker.waiting)) == (1, 1)
        status, headers, text = request(server, "POST", "/v1/chat/completions",
                                        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert status == 429 and json.loads(text)["error"]["type"] == "rate_limit_error", text
        assert json.loads(text)["error"]["code"] == "overloaded", text
        assert 1 <= int(headers["retry-after"]) <= 60, headers
        status, headers, text = request(server, "POST", "/v1/messages",
                                        {"model": "test-model", "max_tokens": 2, "messages": USER})
        assert status == 429 and json.loads(text) == {"type": "error", "error": {
            "type": "rate_limit_error", "message": json.loads(text)["error"]["message"]}}, text
        assert 1 <= int(headers["retry-after"]) <= 60, headers
        for s in socks:
            s.close()
        deadline = time.monotonic() + 30
        while server.worker.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not server.worker.busy and engine.sequences == [0]  # both left; their sequences are dropped
        status, _, text = request(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 200, text


USER = [{"role": "user", "content": "hi"}]
FOREVER = {"prompt": "x", "max_tokens": 10**6, "stream": True}


def generating(server):
    """A stream that generates until its socket is closed; returns once it is the one running job."""
    s = raw_socket(server)
    s.sendall(request_bytes("/v1/completions", FOREVER))
    wait_for(lambda: len(server.worker.running) == 1, "the first request to run", 30)
    return s


def queued(server, path: str, body: dict):
    """A request sent on its own socket, returned once it waits in the queue: (its socket, its job)."""
    before = server.worker.waiting
    s = raw_socket(server)
    s.sendall(request_bytes(path, body))
    wait_for(lambda: len(server.worker.waiting) > len(before), f"{path} to be queued", 30)
    (job,) = [j for j in server.worker.waiting if j not in before]
    return s, job


def test_waiting_requests_enter_the_batch_in_arrival_order():
    engine = SlowEngine(tokenizer().encode("a")[0], delay=0.005)
    with running(model_for(engine, prefix_cache_bytes=0), max_sequences=1, max_waiting=3) as server:
        first = generating(server)
        waiting = [queued(server, "/v1/messages", {"model": "test-model", "max_tokens": 10**6, "stream": True,
                                                   "messages": USER}),
                   queued(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 10**6}),
                   queued(server, "/v1/completions", FOREVER)]
        jobs = [job for _, job in waiting]
        assert server.worker.waiting == jobs
        leaving = first
        for i, (s, job) in enumerate(waiting):
            leaving.close()  # the running request goes; the next in arrival order takes its place
            wait_for(lambda job=job: server.worker.running == [job], f"request {i} to run", 30)
            assert server.worker.waiting == jobs[i + 1:]
            leaving = s
        leaving.close()
        wait_for(lambda: not server.worker.busy, "the last request to leave", 30)
        assert engine.sequences == [0]


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_leaving_the_queue_frees_its_place_at_once_without_work(stream):
    engine = SlowEngine(tokenizer().encode("a")[0], delay=0.005)
    with running(model_for(engine, prefix_cache_bytes=0), max_sequences=1, max_waiting=1) as server:
        first = generating(server)
        (running_job,) = server.worker.running
        s, job = queued(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 10**6, "stream": stream})
        started = []
        job.run = lambda: started.append(job)  # its generation, were it ever started
        status, headers, text = request(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 429, text  # the queue is full
        s.close()
        wait_for(lambda: not server.worker.waiting, "the request that left to leave the queue", 30)
        assert job.cancel_reason == "client disconnected"
        assert server.worker.running == [running_job]  # it left while the batch was still full
        # Its place is free: the next request waits instead of a 429, and is the next to run.
        s2, job2 = queued(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True})
        first.close()
        wait_for(lambda: not server.worker.busy, "the queued request to run and finish", 30)
        data = b""
        while b"data: [DONE]" not in data:
            more = s2.recv(65536)
            assert more, data
            data += more
        s2.close()
        assert data.startswith(b"HTTP/1.1 200") and data.count(b'"text": "a"') == 2, data
        assert started == [] and engine.sequences == [0]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_waiting_stream_is_open_and_pinged_until_its_turn(path):
    engine = SlowEngine(tokenizer().encode("a")[0], delay=0.005)
    ping, end = (b": ping\n\n", b"data: [DONE]") if path == "/v1/chat/completions" else (
        b"event: ping\n", b"event: message_stop")
    with running(model_for(engine, prefix_cache_bytes=0), max_sequences=1,
                 limits=Limits(ping_interval=0.05)) as server:
        first = generating(server)
        s, job = queued(server, path, {"model": "test-model", "messages": USER, "max_tokens": 3, "stream": True})
        s.settimeout(10)
        data = b""
        while data.count(ping) < 4:  # the response head, then pings while it waits
            more = s.recv(65536)
            assert more, data
            data += more
        assert data.startswith(b"HTTP/1.1 200") and server.worker.waiting == [job], data
        first.close()
        while end not in data:
            more = s.recv(65536)
            assert more, data
            data += more
        s.close()
        assert data.count(b': "a"') == 3, data  # its three tokens (as text or reasoning deltas)


def test_a_conversation_resumes_its_cached_prefix_after_another_ran(tiny):
    model = load(tiny)
    a1 = [{"role": "system", "content": "You are a careful assistant."}, {"role": "user", "content": "Hello there"}]
    b1 = [{"role": "user", "content": "Something else entirely, about boats"}]
    body = {"max_tokens": 6, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}
    with running(model, model_id="tiny") as server:
        def turn(messages):
            status, _, text = request(server, "POST", "/v1/chat/completions", {**body, "messages": messages})
            assert status == 200, text
            out = json.loads(text)
            return out["choices"][0]["message"], out["usage"]["prompt_tokens_details"]["cached_tokens"]

        reply_a, cached = turn(a1)
        assert cached == 0
        _, cached_b = turn(b1)
        before = model.cache_info()
        a2 = [*a1, {"role": "assistant", "content": reply_a["content"]}, {"role": "user", "content": "And more?"}]
        _, cached_a2 = turn(a2)
        after = model.cache_info()
    ids_a1 = model.apply_chat_template(a1, tokenize=True, enable_thinking=False)
    im_start = tokenizer().token_to_id("<|im_start|>")
    last_message = max(i for i, t in enumerate(ids_a1) if t == im_start)  # A's copy at its last message start
    assert cached_b < last_message
    assert cached_a2 >= last_message, (cached_a2, last_message)
    assert after.hits == before.hits + 1 and after.tokens_saved - before.tokens_saved == cached_a2


def test_a_finished_reply_is_kept_for_the_next_turn(tiny):
    """A finished request's sequence stays in the prefix cache under its prompt and the reply tokens it
    decoded: a next prompt that re-sends them resumes after the reply, not at the end of the old prompt."""
    model = load(tiny)
    prompt = list(range(40, 90))
    eng, reply = model.engine, []  # the greedy reply, computed on a sequence of its own
    seq = eng.new_sequence()
    logits = eng.prefill(prompt, seq=seq)
    while len(reply) < 8:
        reply.append(int(logits.argmax()))
        if reply[-1] in model.eos_ids:
            break
        logits = eng.decode(reply[-1], seq=seq)
    eng.drop_sequence(seq)
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    with running(model, model_id="tiny") as server:
        status, _, text = request(server, "POST", "/v1/completions", {**body, "prompt": prompt})
        assert status == 200, text
        assert json.loads(text)["usage"]["completion_tokens"] == len(reply)
        status, _, text = request(server, "POST", "/v1/completions", {**body, "prompt": prompt + reply + [7, 8]})
        assert status == 200, text
        cached = json.loads(text)["usage"]["prompt_tokens_details"]["cached_tokens"]
    # The last sampled token was never decoded into the sequence: the kept state ends one before it.
    assert cached == len(prompt) + len(reply) - 1, (cached, len(prompt), reply)


def test_constraints_stops_and_tools_stay_per_request_in_a_batch(tiny):
    """A JSON-schema request, one with a stop string, one with a forced tool call and a plain one, run
    together, each answer exactly what it is alone."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "maxLength": 4}}, "required": ["q"],
        "additionalProperties": False}, "strict": True}}
    user = [{"role": "user", "content": "Answer me"}]
    base = {"temperature": 0, "max_tokens": 40, "chat_template_kwargs": {"enable_thinking": False}}
    bodies = [{**base, "messages": user, "response_format": {"type": "json_schema", "json_schema": {
                   "name": "answer", "schema": schema, "strict": True}}},
              {**base, "messages": [{"role": "user", "content": "Tell a story"}], "stop": ["e"]},
              {**base, "max_tokens": 80, "messages": user, "tools": [tool], "tool_choice": "required"},
              {**base, "messages": [{"role": "user", "content": "Say something"}]}]

    def answers(server, together: bool):
        out: list = [None] * len(bodies)
        errors: list[BaseException] = []

        def one(i):
            try:  # a request that fails says why here, not only as a None in the answers compared below
                status, _, text = request(server, "POST", "/v1/chat/completions", bodies[i], timeout=300)
                assert status == 200, text
                choice = json.loads(text)["choices"][0]
                calls = [c["function"] for c in choice["message"].get("tool_calls") or []]  # ids are random
                out[i] = (choice["message"].get("content"), calls, choice["finish_reason"])
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
            if not together:
                t.join()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out

    with running(load(tiny, prefix_cache_bytes=0), max_sequences=1) as server:
        want = answers(server, together=False)
    model = load(tiny, prefix_cache_bytes=0)
    with running(model, max_sequences=4) as server:
        worker = server.worker

        def hold(event):  # the first prefill waits until the four requests are in
            model.engine.hold = None
            wait_for(lambda: len(worker.running) + len(worker.waiting) == len(bodies), "the four requests", 300)

        model.engine.hold = hold
        got = answers(server, together=True)
    assert got == want
    assert max(len(b) for b in model.engine.batches) > 1, "the requests never decoded together"
    content, _, _ = want[0]
    assert set(json.loads(content)) == {"n", "ok"}
    assert "e" not in want[1][0] and want[1][2] == "stop"
    assert want[2][1][0]["name"] == "lookup" and want[2][2] == "tool_calls"


def test_a_new_server_resumes_a_long_prompt_from_a_snapshot_its_predecessor_wrote(tiny, tmp_path):
    """The scheduler writes the snapshots every ``prefix_cache_snapshot_every`` tokens of a prefill to the disk tier:
    a new server (a new model on the same folder) resumes a prompt that shares only the first 100 tokens of a long
    earlier one from the snapshot at 96, and answers what a server without a prefix cache answers."""
    prompt = list(range(40, 190))  # 150 tokens: snapshots at 32, 64, 96 and 128
    part = prompt[:100] + list(range(300, 320))

    def served(model, tokens):
        with running(model, model_id="tiny") as server:
            status, _, text = request(server, "POST", "/v1/completions",
                                      {"model": "tiny", "max_tokens": 6, "temperature": 0, "prompt": tokens})
        assert status == 200, text
        out = json.loads(text)
        return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]

    first = load(tiny, prefix_cache_dir=tmp_path, prefix_cache_snapshot_every=32)
    disk = first.prefix.cache.disk
    store = disk.store
    # Each write done before the next prefill piece, so that no snapshot is skipped for a busy writer (timing).
    disk.store = lambda *a, **kw: (store(*a, **kw), disk.flush(600))[0]
    assert served(first, prompt)[1] == 0
    assert disk.flush(600) and {32, 64, 96, 128, len(prompt)} <= {e.length for e in disk._files.values()}
    second = load(tiny, prefix_cache_dir=tmp_path)
    assert second.cache_info().disk_entries == len(list(tmp_path.glob("*.safetensors")))
    text, cached = served(second, part)
    info = second.cache_info()
    assert cached == 96 and (info.hits, info.tokens_saved, info.disk_hits) == (1, 96, 1)
    assert second.prefix.cache.disk.flush(600)  # its own files: the end of its prompt and of its reply
    files = list(tmp_path.glob("*.safetensors"))
    info = second.cache_info()
    assert (info.disk_entries, info.disk_bytes) == (len(files), sum(f.stat().st_size for f in files))
    assert text == served(load(tiny, prefix_cache_bytes=0), part)[0]
