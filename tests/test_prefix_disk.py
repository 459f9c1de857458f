"""The prefix cache's disk tier: a prompt resumed from a file (a prefix ending mid-chunk, and one at a
snapshot) gives the logits of a cold run; corrupt, truncated, foreign-model and wrong-KV-dtype files are
ignored, never loaded; the directory stays within its byte bound, least recently used files deleted
first; a new process resumes from the directory."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import safetensors
from lily.prefix import DiskTier, PrefixCache, PrefixReuse, model_fingerprint

BOUNDARY = 3
CKPT = "real-s0-q4g64"


def toks(seed, n, vocab=512):
    return [int(t) + 4 for t in np.random.default_rng(seed).integers(0, vocab - 4, n)]


def _engine(lily, ckpts, name=CKPT, kv_dtype="f32"):
    return lily.Engine(ckpts.path(name), backend="cpu", max_seq=1024, kv_dtype=kv_dtype, prefill_chunk=32)


@pytest.fixture(scope="module")
def cold(lily, ckpts):
    return _engine(lily, ckpts)


class Written(PrefixReuse):
    """A ``PrefixReuse`` whose prefill returns once its disk writes (made on the writer thread) are done."""

    def prefill(self, tokens, ticket=None):
        out = super().prefill(tokens, ticket)
        assert self.cache.disk.flush(600)
        return out


class Synced(DiskTier):
    """A ``DiskTier`` whose ``store`` returns once the write is done, so that every snapshot of a long prefill finds
    the queue empty and is written (a ``DiskTier`` skips one while another write is queued: timing)."""

    def store(self, *args, **kw):
        out = super().store(*args, **kw)
        assert self.flush(600)
        return out


def reuse(engine, ckpts, directory, name=CKPT, max_bytes=1 << 40, memory_bytes=1 << 40, kind=Written, tier=Synced,
          **kw):
    disk = tier(directory, model_fingerprint(ckpts.path(name), engine.config), engine.kv_dtype, max_bytes, **kw)
    return kind(engine, BOUNDARY, PrefixCache(engine, memory_bytes, snapshot_every=48, disk=disk))


def cold_logits(cold, tokens):
    cold.reset()
    return cold.prefill(tokens)


@pytest.mark.parametrize("first_len", [
    40,  # ends mid-chunk (chunks of 32), before any snapshot
    96,  # ends at a snapshot point (2 x 48)
])
def test_resumed_from_disk_equals_a_cold_run(lily, ckpts, cold, tmp_path, first_len):
    first = toks(1, first_len)
    reuse(_engine(lily, ckpts), ckpts, tmp_path).prefill(first)
    # A new engine and cache (nothing in memory): only the files can give the prefix.
    engine = _engine(lily, ckpts)
    r = reuse(engine, ckpts, tmp_path)
    second = first + [BOUNDARY] + toks(2, 25)
    logits, start = r.prefill(second)
    assert start == first_len
    assert np.abs(logits - cold_logits(cold, second)).max() <= 1e-4
    info = r.cache.info()
    assert (info.hits, info.tokens_saved, info.disk_hits) == (1, first_len, 1)
    # The identical prompt again, from a third cache: its end-of-prompt file holds the logits.
    r3 = reuse(_engine(lily, ckpts), ckpts, tmp_path)
    again, start = r3.prefill(second)
    assert start == len(second) and np.abs(again - logits).max() <= 1e-6


def _entry_files(directory):
    return sorted(directory.glob("*.safetensors"), key=lambda f: f.stat().st_size)


def _assert_ignored(lily, ckpts, directory, caplog, why):
    engine = _engine(lily, ckpts)
    with caplog.at_level(logging.DEBUG, logger="lily.prefix"):
        r = reuse(engine, ckpts, directory)
        logits, start = r.prefill(toks(1, 40) + [BOUNDARY] + toks(2, 5))
    assert start == 0 and r.cache.info().disk_hits == 0
    assert why in caplog.text, caplog.text
    return r


def test_corrupt_file_is_ignored(lily, ckpts, tmp_path, caplog):
    reuse(_engine(lily, ckpts), ckpts, tmp_path).prefill(toks(1, 40))
    (f,) = _entry_files(tmp_path)
    data = bytearray(f.read_bytes())
    n = int.from_bytes(data[:8], "little")
    offsets = json.loads(data[8:8 + n])["layers.0.ssm"]["data_offsets"]
    data[8 + n + offsets[0] + 100] ^= 0x40  # one bit of a DeltaNet state
    f.write_bytes(bytes(data))
    _assert_ignored(lily, ckpts, tmp_path, caplog, "checksum mismatch")


def test_truncated_file_is_ignored(lily, ckpts, tmp_path, caplog):
    reuse(_engine(lily, ckpts), ckpts, tmp_path).prefill(toks(1, 40))
    (f,) = _entry_files(tmp_path)
    data = f.read_bytes()
    f.write_bytes(data[:len(data) // 2])
    _assert_ignored(lily, ckpts, tmp_path, caplog, "unreadable")
    for g in _entry_files(tmp_path):  # what the first check wrote
        g.unlink()
    f.write_bytes(data[:5])  # not even a header length
    _assert_ignored(lily, ckpts, tmp_path, caplog, "unreadable")


def test_foreign_model_file_is_ignored(lily, ckpts, tmp_path, caplog):
    # Another random checkpoint of the same architecture and shapes writes the directory.
    other = "real-s1-q4g64"
    reuse(_engine(lily, ckpts, other), ckpts, tmp_path, name=other).prefill(toks(1, 40))
    (theirs,) = _entry_files(tmp_path)
    data = theirs.read_bytes()
    _assert_ignored(lily, ckpts, tmp_path, caplog, "another model")
    assert theirs.read_bytes() == data  # left alone: it is the other model's


def test_fingerprint_tells_checkpoints_of_identical_headers_apart(ckpts, tmp_path):
    # Same config, same safetensors headers and sizes, other weight bytes: what two random checkpoints
    # of one shape (or a fine-tune) look like.
    src = ckpts.path(CKPT)
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    config = json.loads((src / "config.json").read_text())
    assert model_fingerprint(copy, config) == model_fingerprint(src, config)
    for f in sorted(copy.glob("*.safetensors")):
        data = bytearray(f.read_bytes())
        n = int.from_bytes(data[:8], "little")
        body = np.frombuffer(data, np.uint8, offset=8 + n)
        data[8 + n:] = np.random.default_rng(0).permutation(body).tobytes()
        f.write_bytes(bytes(data))
    assert model_fingerprint(copy, config) != model_fingerprint(src, config)


def test_wrong_kv_dtype_file_is_ignored(lily, ckpts, tmp_path, caplog):
    bf16 = _engine(lily, ckpts, kv_dtype="bf16")
    reuse(bf16, ckpts, tmp_path).prefill(toks(1, 40))
    _assert_ignored(lily, ckpts, tmp_path, caplog, "KV rows are bf16")


def test_a_crashed_write_leaves_no_entry(lily, ckpts, tmp_path):
    reuse(_engine(lily, ckpts), ckpts, tmp_path).prefill(toks(1, 40))
    (f,) = _entry_files(tmp_path)
    # What a writer that died before its rename leaves: a temporary file (of a pid that is not running).
    tmp = tmp_path / f".{f.name}.999999999.tmp"
    tmp.write_bytes(f.read_bytes()[:1000])
    f.unlink()
    r = reuse(_engine(lily, ckpts), ckpts, tmp_path)
    assert len(r.cache.disk) == 0 and not tmp.exists()


def test_eviction_under_a_small_directory_bound(lily, ckpts, tmp_path):
    engine = _engine(lily, ckpts)
    r = reuse(engine, ckpts, tmp_path)
    r.prefill(toks(1, 20))
    one = r.cache.disk.bytes
    assert one > 0
    bound = int(2.5 * one)
    r = reuse(engine, ckpts, tmp_path, max_bytes=bound)
    for seed in (2, 3, 4):  # same length: same file size
        r.prefill(toks(seed, 20))
        assert r.cache.disk.bytes <= bound
    assert r.cache.disk.evictions == 2
    names = {f.name for f in _entry_files(tmp_path)}
    assert len(names) == 2 and sum(f.stat().st_size for f in _entry_files(tmp_path)) <= bound
    assert not r.cache.disk.holds(toks(1, 20)) and not r.cache.disk.holds(toks(2, 20))
    assert r.cache.disk.holds(toks(3, 20)) and r.cache.disk.holds(toks(4, 20))
    # A file too large for the bound is not written at all.
    tiny = reuse(engine, ckpts, tmp_path / "tiny", max_bytes=one // 2)
    tiny.prefill(toks(5, 20))
    assert len(tiny.cache.disk) == 0 and not _entry_files(tmp_path / "tiny")


def test_a_new_process_resumes_from_the_directory(lily, ckpts, tmp_path):
    first = toks(1, 100)
    model_dir, cache_dir = ckpts.path(CKPT), tmp_path / "cache"
    script = textwrap.dedent(f"""
        import json, sys
        import numpy as np
        import lily
        from lily.prefix import DiskTier, PrefixCache, PrefixReuse, model_fingerprint
        engine = lily.Engine({str(model_dir)!r}, backend="cpu", max_seq=1024, kv_dtype="f32", prefill_chunk=32)
        disk = DiskTier({str(cache_dir)!r}, model_fingerprint({str(model_dir)!r}, engine.config), "f32")
        r = PrefixReuse(engine, {BOUNDARY}, PrefixCache(engine, 1 << 40, snapshot_every=48, disk=disk))
        logits, start = r.prefill(json.loads(sys.argv[1]))
        disk.flush()  # the end-of-prompt file is written on the writer thread
        i = r.cache.info()
        np.save(sys.argv[2], logits)
        print(json.dumps([start, i.hits, i.tokens_saved, i.disk_hits, i.disk_entries]))
    """)

    def run(tokens, out):
        p = subprocess.run([sys.executable, "-c", script, json.dumps(tokens), str(out)], capture_output=True,
                           text=True, timeout=600, env={**os.environ})
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout.strip().splitlines()[-1]), np.load(out)

    (start, hits, saved, disk_hits, entries), _ = run(first, tmp_path / "a.npy")
    # The snapshot at 48, the one at 96 if the writer was done with 48 by then (else skipped), the end of the prompt.
    assert (start, hits, disk_hits) == (0, 0, 0) and entries in (2, 3)
    second = first + [BOUNDARY] + toks(2, 30)
    (start, hits, saved, disk_hits, _), logits = run(second, tmp_path / "b.npy")
    assert (start, hits, saved, disk_hits) == (100, 1, 100, 1)
    cold = _engine(lily, ckpts)
    assert np.abs(logits - cold.prefill(second)).max() <= 1e-4


def test_load_with_prefix_cache_dir_resumes_in_a_new_process(ckpts, tmp_path):
    # The user's path: lily.load(prefix_cache_dir=...), generate, exit; a new process sends the
    # conversation with one more message.
    script = textwrap.dedent(f"""
        import json, sys
        import lily
        model = lily.load({str(ckpts.path(CKPT))!r}, backend="cpu", max_seq=512, progress=False,
                          prefix_cache_dir={str(tmp_path / "cache")!r})
        out = model.generate(json.loads(sys.argv[1]), max_tokens=4, temperature=0)
        i = model.cache_info()
        print(json.dumps([out.tokens, out.stats.cached_prompt_tokens, i.hits, i.tokens_saved, i.disk_hits]))
    """)

    def run(tokens):
        p = subprocess.run([sys.executable, "-c", script, json.dumps(tokens)], capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout.strip().splitlines()[-1])

    ids = toks(7, 90)
    first = run(ids)
    assert first[1:] == [0, 0, 0, 0]
    again = run(ids)  # the identical prompt: its end-of-prompt state and logits, from disk
    assert again == [first[0], 90, 1, 90, 1]


def _held_writes(disk):
    """Make ``disk``'s writer wait for the returned event before each write."""
    release, write = threading.Event(), disk._write

    def held(*args):
        assert release.wait(600)
        write(*args)

    disk._write = held
    return release


def test_a_turn_end_does_not_wait_for_its_disk_write(lily, ckpts, tmp_path):
    """The write runs on the writer thread: the prefill returns while it is held; a write beyond
    ``max_pending`` queued ones is dropped and counted; ``flush`` waits for the rest."""
    r = reuse(_engine(lily, ckpts), ckpts, tmp_path, kind=PrefixReuse, tier=DiskTier, max_pending=1)
    disk = r.cache.disk
    release = _held_writes(disk)
    first, second = toks(1, 40), toks(2, 40)
    r.prefill(first)  # returns although its file is not written
    assert disk.pending == 1 and disk.holds(first) and not _entry_files(tmp_path)
    r.prefill(second)  # the queue is full: dropped, not waited for
    assert r.cache.info().disk_dropped == 1 and not disk.holds(second)
    release.set()
    assert disk.flush(600) and disk.pending == 0
    assert len(_entry_files(tmp_path)) == 1 and disk.holds(first) and len(disk) == 1
    assert not list(tmp_path.glob(".*.tmp"))
    info = r.cache.info()
    assert (info.disk_entries, info.disk_dropped, info.disk_write_errors) == (1, 1, 0)


def test_a_failed_write_is_logged_counted_and_leaves_nothing(lily, ckpts, tmp_path, caplog, monkeypatch):
    r = reuse(_engine(lily, ckpts), ckpts, tmp_path)

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with caplog.at_level(logging.WARNING, logger="lily.prefix"):
        r.prefill(toks(1, 40))
    assert "could not write" in caplog.text and "No space left" in caplog.text
    info = r.cache.info()
    assert (info.disk_entries, info.disk_bytes, info.disk_write_errors) == (0, 0, 1)
    assert not list(tmp_path.iterdir())  # no entry, no temporary file


def test_closing_the_scheduler_flushes_the_disk_writes(ckpts, tmp_path):
    import lily
    from lily.server.worker import Scheduler

    model = lily.load(ckpts.path(CKPT), backend="cpu", max_seq=512, progress=False, prefix_cache_dir=tmp_path)
    disk = model.prefix.cache.disk
    release = _held_writes(disk)
    model.generate(toks(3, 30), max_tokens=2, temperature=0)
    assert disk.pending == 1
    scheduler = Scheduler(model)
    closing = threading.Thread(target=scheduler.close)
    closing.start()
    closing.join(1.0)
    assert closing.is_alive(), "the scheduler closed before the queued disk write was made"
    release.set()
    closing.join(600)
    assert not closing.is_alive() and len(_entry_files(tmp_path)) == 1


def test_a_process_that_exits_writes_its_queued_entries(ckpts, tmp_path):
    script = textwrap.dedent(f"""
        import time
        import lily
        model = lily.load({str(ckpts.path(CKPT))!r}, backend="cpu", max_seq=512, progress=False,
                          prefix_cache_dir={str(tmp_path)!r})
        disk = model.prefix.cache.disk
        write = disk._write
        disk._write = lambda *a: (time.sleep(2), write(*a))  # still writing when the script ends
        model.generate({toks(4, 30)!r}, max_tokens=2, temperature=0)
        assert disk.pending == 1
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert len(_entry_files(tmp_path)) == 1 and not list(tmp_path.glob(".*.tmp"))


# ---- incremental files: a turn end that extends a written file stores only its new rows


def conversation(turns):
    """The prompts of a conversation's turns, each the previous one and a message more."""
    ids = toks(1, 40)
    out = [ids]
    for i in range(turns - 1):
        ids = ids + [BOUNDARY] + toks(10 + i, 25)
        out.append(ids)
    return out


def _file_of(directory, position):
    """The file of the entry of ``position`` tokens: (path, metadata, {K/V tensor: rows})."""
    for f in directory.glob("*.safetensors"):
        with safetensors.safe_open(str(f), "numpy") as st:
            meta = st.metadata()
            if int(meta["position"]) == position:
                return f, meta, {k: st.get_slice(k).get_shape()[0] for k in st.keys() if k.endswith((".k", ".v"))}
    raise AssertionError(f"no file of {position} tokens")


def _flip_bit(path, suffix):
    """Flip one bit of the first tensor of ``path`` whose name ends with ``suffix``."""
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    tensor = next(k for k in sorted(header) if k.endswith(suffix))
    data[8 + n + header[tensor]["data_offsets"][0] + 100] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_conversation_writes_each_row_once_and_resumes_through_the_chain(lily, ckpts, cold, tmp_path):
    turns = conversation(4)  # 40, 66, 92 and 118 tokens
    r = reuse(_engine(lily, ckpts), ckpts, tmp_path)
    ended = [r.prefill(t)[0] for t in turns]
    disk = r.cache.disk
    # The turn ends and the snapshots every 48 tokens (each the first write of its prefill: the queue is empty).
    ends = [0, 40, 48, 66, 92, 96, 118]
    assert len(disk) == len(ends) - 1 == len(_entry_files(tmp_path))
    # Each file holds the rows after the previous file, which it names: every row is written once.
    rows_written = 0
    for prev, end in zip(ends, ends[1:]):
        _, meta, rows = _file_of(tmp_path, end)
        assert int(meta["start"]) == prev and set(rows.values()) == {end - prev}, (meta, rows)
        assert meta["parent"] == (_file_of(tmp_path, prev)[0].name if prev else "")
        rows_written += sum(rows.values())
    assert rows and rows_written == len(rows) * len(turns[-1])  # not sum(len(t)): what full files would take
    assert disk.written == sum(f.stat().st_size for f in _entry_files(tmp_path)) == disk.bytes
    # A new process's cache resumes the last turn through the chain of four files, and any turn of it.
    fresh = reuse(_engine(lily, ckpts), ckpts, tmp_path)
    nxt = turns[-1] + [BOUNDARY] + toks(20, 10)
    logits, start = fresh.prefill(nxt)
    assert start == len(turns[-1]) and np.abs(logits - cold_logits(cold, nxt)).max() <= 1e-4
    for t, end in zip(turns[:2], ended):
        again, start = reuse(_engine(lily, ckpts), ckpts, tmp_path).prefill(t)
        assert start == len(t) and np.abs(again - end).max() <= 1e-6


def _spans(directory):
    """(start, position) of every file in ``directory``."""
    out = set()
    for f in directory.glob("*.safetensors"):
        with safetensors.safe_open(str(f), "numpy") as st:
            meta = st.metadata()
            out.add((int(meta["start"]), int(meta["position"])))
    return out


def test_a_history_rendered_anew_extends_the_last_message_start(lily, ckpts, cold, tmp_path):
    """Qwen's template drops the reasoning of earlier turns once a new user message comes, so the next prompt does
    not extend the previous one; it extends the previous prompt's last-message start, which is written too."""
    head = toks(1, 40)
    first = head + [BOUNDARY] + toks(2, 20)  # its last message starts at 40
    second = head + [BOUNDARY] + toks(2, 12) + toks(3, 6) + [BOUNDARY] + toks(4, 20)  # that message, re-rendered
    r = reuse(_engine(lily, ckpts), ckpts, tmp_path)
    r.prefill(first)
    r.prefill(second)
    # The first prompt's last-message start (40 tokens) is the only whole file; the rest extend it or each other: the
    # snapshot at 48 extends it, the first prompt's end and the second's last-message start (59) extend that.
    assert _spans(tmp_path) == {(0, 40), (40, 48), (48, len(first)), (48, 59), (59, len(second))}
    nxt = second + [BOUNDARY] + toks(5, 10)
    logits, start = reuse(_engine(lily, ckpts), ckpts, tmp_path).prefill(nxt)
    assert start == len(second) and np.abs(logits - cold_logits(cold, nxt)).max() <= 1e-4


def test_a_broken_parent_makes_the_files_extending_it_unusable(lily, ckpts, cold, tmp_path, caplog):
    turns = conversation(3)
    r = reuse(_engine(lily, ckpts), ckpts, tmp_path)
    for t in turns:
        r.prefill(t)
    root, mid, leaf = (_file_of(tmp_path, len(t))[0] for t in turns)
    nxt = turns[-1] + [BOUNDARY] + toks(20, 10)
    # Only the rows of a parent are used: a flipped bit in the middle file's DeltaNet state (what resuming its own
    # turn would load) leaves the last turn's chain whole, while that turn itself is refused.
    _flip_bit(mid, ".ssm")
    logits, start = reuse(_engine(lily, ckpts), ckpts, tmp_path).prefill(nxt)
    assert start == len(turns[-1]) and np.abs(logits - cold_logits(cold, nxt)).max() <= 1e-4
    with caplog.at_level(logging.WARNING, logger="lily.prefix"):
        _, start = reuse(_engine(lily, ckpts), ckpts, tmp_path).prefill(turns[1])
    assert start == 48 and "checksum mismatch" in caplog.text  # from the snapshot it extends, not the broken file
    # A flipped bit in the middle file's K rows: the last file, which extends it, is ignored too (never loaded with
    # wrong rows); the files before it (the first turn's, the snapshot at 48) still serve.
    _flip_bit(mid, ".k")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lily.prefix"):
        again = reuse(_engine(lily, ckpts), ckpts, tmp_path)
        logits, start = again.prefill(nxt)
    assert start == 48 and np.abs(logits - cold_logits(cold, nxt)).max() <= 1e-4
    # (the file it tried first was the one of ``nxt`` itself, written by the first resumption: a fourth link)
    assert f"ignoring {mid} (and " in caplog.text and "which extends it): checksum mismatch" in caplog.text
    disk = again.cache.disk
    assert not disk.holds(turns[1]) and all(mid.name not in {c.name for c in e.chain()} for e in disk._files.values())
    # Prefilled from the snapshot at 48, ``nxt`` wrote its last-message start (the last turn), its snapshot at 96 and
    # its end again, now extending that snapshot.
    assert [c.length for c in disk.longest(nxt, len(nxt)).chain()] == [len(nxt), 96, len(turns[2]), 48, len(turns[0])]


def test_a_missing_parent_removes_the_files_extending_it(lily, ckpts, cold, tmp_path):
    turns = conversation(3)
    r = reuse(_engine(lily, ckpts), ckpts, tmp_path)
    for t in turns:
        r.prefill(t)
    root, mid, leaf = (_file_of(tmp_path, len(t))[0] for t in turns)
    snapshot = _file_of(tmp_path, 48)[0]  # the second turn's snapshot at 48, which ``mid`` extends
    mid.unlink()  # what another process sharing the directory may have evicted
    scanned = reuse(_engine(lily, ckpts), ckpts, tmp_path)
    assert {f.name for f in _entry_files(tmp_path)} == {root.name, snapshot.name} and len(scanned.cache.disk) == 2
    nxt = turns[2] + [BOUNDARY] + toks(21, 5)
    logits, start = scanned.prefill(nxt)
    assert start == 48 and np.abs(logits - cold_logits(cold, nxt)).max() <= 1e-4


def test_a_foreign_models_chain_is_ignored_and_left_alone(lily, ckpts, tmp_path, caplog):
    other = "real-s1-q4g64"
    theirs = reuse(_engine(lily, ckpts, other), ckpts, tmp_path, name=other)
    turns = conversation(2)
    for t in turns:
        theirs.prefill(t)
    before = {f.name: f.read_bytes() for f in _entry_files(tmp_path)}
    assert len(before) == 3  # 40, its snapshot at 48, 66
    with caplog.at_level(logging.DEBUG, logger="lily.prefix"):
        ours = reuse(_engine(lily, ckpts), ckpts, tmp_path)
        _, start = ours.prefill(turns[1] + [BOUNDARY] + toks(20, 5))
    assert start == 0 and ours.cache.info().disk_hits == 0 and "another model" in caplog.text
    assert {f.name: f.read_bytes() for f in _entry_files(tmp_path) if f.name in before} == before


def test_evicting_a_file_evicts_the_files_that_extend_it(lily, ckpts, tmp_path):
    engine = _engine(lily, ckpts)
    turns, other = conversation(2), toks(9, 40)

    def written(directory):
        r = reuse(engine, ckpts, directory)
        for t in turns:
            r.prefill(t)
        root, child = (_file_of(directory, len(t))[0] for t in turns)
        return r.cache.disk, root, child

    # A parent is touched after its child, so the least recently used file is the child: evicted alone.
    disk, root, child = written(tmp_path / "a")
    snapshot = _file_of(tmp_path / "a", 48)[0]  # the second turn's snapshot at 48: the child extends it
    assert list(disk._files) == [child.name, snapshot.name, root.name]
    size = root.stat().st_size  # an unrelated prompt of as many tokens writes a file of this size
    disk.max_bytes = disk.bytes + size - 1
    Written(engine, BOUNDARY, PrefixCache(engine, 1 << 40, snapshot_every=48, disk=disk)).prefill(other)
    assert disk.evictions == 1 and not child.exists() and root.exists() and snapshot.exists()
    assert disk.holds(turns[0]) and disk.holds(other) and not disk.holds(turns[1])
    assert disk.bytes == sum(f.stat().st_size for f in _entry_files(tmp_path / "a")) <= disk.max_bytes
    # When the parent is the least recent (here: by mtime, as another process may leave it), evicting it
    # deletes the child too.
    _, root, child = written(tmp_path / "b")
    snapshot = _file_of(tmp_path / "b", 48)[0]
    for i, f in enumerate((root, child, snapshot)):
        os.utime(f, (i + 1, i + 1))
    r = reuse(engine, ckpts, tmp_path / "b")
    disk = r.cache.disk
    assert list(disk._files) == [root.name, child.name, snapshot.name]
    disk.max_bytes = disk.bytes + size - 1
    r.prefill(other)
    assert disk.evictions == 3 and not any(f.exists() for f in (root, child, snapshot)) and len(disk) == 1
    assert disk.bytes == sum(f.stat().st_size for f in _entry_files(tmp_path / "b"))


def test_an_entry_extends_a_file_still_queued(lily, ckpts, cold, tmp_path, monkeypatch):
    # Both turn ends are queued before either is written (the writer is held): the second is exported from the
    # first's length on and written after it, extending it.
    r = reuse(_engine(lily, ckpts), ckpts, tmp_path, kind=PrefixReuse, tier=DiskTier, max_pending=2)
    disk = r.cache.disk
    release = _held_writes(disk)
    turns = conversation(2)
    for t in turns:
        r.prefill(t)
    # The second turn's snapshot at 48 found the first turn's write queued: skipped, not queued behind it.
    assert disk.pending == 2 and r.cache.info().disk_skipped == 1
    release.set()
    assert disk.flush(600) and _spans(tmp_path) == {(0, len(turns[0])), (len(turns[0]), len(turns[1]))}
    nxt = turns[1] + [BOUNDARY] + toks(30, 5)
    logits, start = reuse(_engine(lily, ckpts), ckpts, tmp_path).prefill(nxt)
    assert start == len(turns[1]) and np.abs(logits - cold_logits(cold, nxt)).max() <= 1e-4
    # When the queued parent's write fails, the entry extending it (whose earlier rows are in no file) is dropped.
    r = reuse(_engine(lily, ckpts), ckpts, tmp_path / "failed", kind=PrefixReuse, tier=DiskTier, max_pending=2)
    disk = r.cache.disk
    release = _held_writes(disk)
    replace = os.replace
    failed = []

    def fail_once(src, dst):
        if not failed:
            failed.append(dst)
            raise OSError(28, "No space left on device")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", fail_once)
    for t in turns:
        r.prefill(t)
    release.set()
    assert disk.flush(600)
    info = r.cache.info()
    assert (info.disk_entries, info.disk_write_errors, info.disk_dropped) == (0, 1, 1)
    assert not _entry_files(tmp_path / "failed")


# ---- the snapshots every ``snapshot_every`` tokens of a long prefill reach the disk tier too


LONG = 200  # snapshots at 48, 96, 144 and 192 (prefill chunks of 32: 48 and 144 end mid-chunk)


def test_a_prefill_killed_half_way_resumes_from_its_deepest_snapshot_on_disk(lily, ckpts, cold, tmp_path):
    """A process killed (SIGKILL) during a long prefill, after its snapshots at 48, 96 and 144 were written: a new
    process resumes the prompt from 144, and a prompt that shares only its first 120 tokens from 96, with the
    logits of a cold run."""
    prompt = toks(40, LONG)
    model_dir, cache_dir = ckpts.path(CKPT), tmp_path / "cache"
    script = textwrap.dedent(f"""
        import json, os, signal, sys
        import lily
        from lily.prefix import DiskTier, PrefixCache, PrefixReuse, model_fingerprint

        class Killed:
            '''The engine; its fourth prefill call (the piece after the snapshot at 144) kills the process, once the
            snapshots' writes queued so far are done (so that the writer's timing does not decide what is on disk).'''
            def __init__(self, engine):
                self.engine, self.calls = engine, 0
            def __getattr__(self, name):
                return getattr(self.engine, name)
            def prefill(self, tokens, **kw):
                self.calls += 1
                if self.calls == 4:
                    assert disk.flush(600)
                    os.kill(os.getpid(), signal.SIGKILL)
                assert disk.flush(600)
                return self.engine.prefill(tokens, **kw)

        engine = Killed(lily.Engine({str(model_dir)!r}, backend="cpu", max_seq=1024, kv_dtype="f32", prefill_chunk=32))
        disk = DiskTier({str(cache_dir)!r}, model_fingerprint({str(model_dir)!r}, engine.config), "f32")
        PrefixReuse(engine, {BOUNDARY}, PrefixCache(engine, 1 << 40, snapshot_every=48, disk=disk)).prefill(
            json.loads(sys.argv[1]))
        print("not killed")
    """)
    p = subprocess.run([sys.executable, "-c", script, json.dumps(prompt)], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == -9, (p.returncode, p.stdout, p.stderr)
    # One chain: every row up to 144 written once, each file extending the one before.
    assert _spans(cache_dir) == {(0, 48), (48, 96), (96, 144)}
    for end in (96, 144):
        assert _file_of(cache_dir, end)[1]["parent"] == _file_of(cache_dir, end - 48)[0].name
    again = prompt + [BOUNDARY] + toks(41, 10)
    r = reuse(_engine(lily, ckpts), ckpts, cache_dir)
    logits, start = r.prefill(again)
    assert start == 144 and np.abs(logits - cold_logits(cold, again)).max() <= 1e-4
    info = r.cache.info()
    assert (info.hits, info.tokens_saved, info.disk_hits) == (1, 144, 1)
    # This process went on from 144: its snapshot at 192, its last-message start (200) and its end extend the chain.
    assert _spans(cache_dir) == {(0, 48), (48, 96), (96, 144), (144, 192), (192, LONG), (LONG, len(again))}
    part = prompt[:120] + toks(42, 30)  # shares 120 tokens: the deepest snapshot within them is at 96
    logits, start = reuse(_engine(lily, ckpts), ckpts, cache_dir).prefill(part)
    assert start == 96 and np.abs(logits - cold_logits(cold, part)).max() <= 1e-4


def test_a_snapshot_is_skipped_not_queued_behind_a_write(lily, ckpts, cold, tmp_path):
    """While the writer is busy the snapshots of a long prefill are skipped (counted), and the prompt's end, which
    keeps its place in the queue, extends the last file queued: every row is still written once."""
    r = reuse(_engine(lily, ckpts), ckpts, tmp_path, kind=PrefixReuse, tier=DiskTier, max_pending=1)
    disk = r.cache.disk
    release = _held_writes(disk)
    prompt = toks(43, LONG)
    try:
        r.prefill(prompt)
        info = r.cache.info()
        assert disk.pending == 2 and (info.disk_skipped, info.disk_dropped) == (3, 0)  # 96, 144, 192 skipped
    finally:  # (a failure must not leave the writer, which the process waits for, held)
        release.set()
    assert disk.flush(600) and _spans(tmp_path) == {(0, 48), (48, LONG)}
    again = prompt + [BOUNDARY] + toks(44, 5)
    logits, start = reuse(_engine(lily, ckpts), ckpts, tmp_path).prefill(again)
    assert start == LONG and np.abs(logits - cold_logits(cold, again)).max() <= 1e-4


def _chain_is_whole(disk, directory):
    """Every file in ``directory`` is in ``disk``'s index, and names a parent that is there too."""
    names = {f.name for f in _entry_files(directory)}
    assert names == set(disk._files), (names, set(disk._files))
    for f in _entry_files(directory):
        with safetensors.safe_open(str(f), "numpy") as st:
            parent = st.metadata()["parent"]
        assert not parent or parent in names, (f.name, parent)


def test_snapshot_chains_stay_whole_under_the_directory_bound(lily, ckpts, cold, tmp_path):
    prompt = toks(45, LONG)
    probe = reuse(_engine(lily, ckpts), ckpts, tmp_path / "probe")
    probe.prefill(prompt)
    sizes = {end: _file_of(tmp_path / "probe", end)[0].stat().st_size for _, end in _spans(tmp_path / "probe")}
    assert set(sizes) == {48, 96, 144, 192, LONG}
    # Room for the first three files: the snapshot at 192 does not fit with the chain it extends, nor does the end
    # (which then extends 144), so both are dropped; what is written is a whole chain, resumed from 144.
    bound = sizes[48] + sizes[96] + sizes[144] + sizes[192] // 2
    r = reuse(_engine(lily, ckpts), ckpts, tmp_path / "d", max_bytes=bound)
    r.prefill(prompt)
    disk = r.cache.disk
    assert _spans(tmp_path / "d") == {(0, 48), (48, 96), (96, 144)} and disk.dropped == 2 and disk.bytes <= bound
    _chain_is_whole(disk, tmp_path / "d")
    again = prompt + [BOUNDARY] + toks(46, 5)
    logits, start = reuse(_engine(lily, ckpts), ckpts, tmp_path / "d", max_bytes=bound).prefill(again)
    assert start == 144 and np.abs(logits - cold_logits(cold, again)).max() <= 1e-4
    # Another long prompt under the same bound evicts the least recent chain from its newest file on: at every step
    # the directory holds whole chains, and the first prompt still resumes from the deepest file it kept.
    other = reuse(_engine(lily, ckpts), ckpts, tmp_path / "d", max_bytes=bound)
    other.prefill(toks(47, 100))
    disk = other.cache.disk
    assert disk.evictions > 0 and disk.bytes <= bound
    _chain_is_whole(disk, tmp_path / "d")
    fresh = reuse(_engine(lily, ckpts), ckpts, tmp_path / "d", max_bytes=bound)
    deepest = fresh.cache.disk.longest(again, len(again))
    logits, start = fresh.prefill(again)
    assert start == (deepest.length if deepest is not None else 0) and start < 144
    assert np.abs(logits - cold_logits(cold, again)).max() <= 1e-4


def test_a_corrupt_snapshot_file_makes_the_files_extending_it_unusable(lily, ckpts, cold, tmp_path, caplog):
    prompt = toks(48, LONG)
    reuse(_engine(lily, ckpts), ckpts, tmp_path).prefill(prompt)
    assert _spans(tmp_path) == {(0, 48), (48, 96), (96, 144), (144, 192), (192, LONG)}
    broken = _file_of(tmp_path, 96)[0]
    _flip_bit(broken, ".k")
    again = prompt + [BOUNDARY] + toks(49, 5)
    with caplog.at_level(logging.WARNING, logger="lily.prefix"):
        r = reuse(_engine(lily, ckpts), ckpts, tmp_path)
        logits, start = r.prefill(again)
    # The end (200) was tried first: its chain reached the broken snapshot, so neither it nor 144 or 192 (which
    # extend it) is used; the snapshot at 48, before it, is.
    assert start == 48 and np.abs(logits - cold_logits(cold, again)).max() <= 1e-4
    assert f"ignoring {broken} (and " in caplog.text and "checksum mismatch" in caplog.text
    assert r.cache.info().disk_hits == 1  # only the file at 48 was loaded
    # Prefilled from 48, this process wrote the snapshots and the end again: the directory is one whole chain, and
    # the prompt resumes from its end.
    _chain_is_whole(r.cache.disk, tmp_path)
    logits2, start = reuse(_engine(lily, ckpts), ckpts, tmp_path).prefill(again)
    assert start == len(again) and np.abs(logits2 - logits).max() <= 1e-6
