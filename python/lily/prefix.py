"""Prefix reuse across conversations: a byte-bounded cache of engine sequences keyed by their token
prefixes, so a new prompt that starts like any earlier one (the next turn of a chat, an agent resending
its history, a regenerated reply, another sub-task with the same system prompt and tools) only prefills
what is new.

The DeltaNet state cannot be cut back like a KV cache, so a prefix is resumed from a copy of the whole
sequence state taken at that position (KV rows + DeltaNet conv and recurrent states, about 63 MB plus
20 KiB per token for Qwen3.6-35B-A3B with a bf16 cache). Copies are taken at the end of every prompt (with
its last logits, so an identical prompt resends nothing), at the start of its last message (the last
``<|im_start|>``: the point the next turn, or a regenerated reply, shares) and every ``snapshot_every``
tokens of a long prefill. They are kept in a radix tree over token ids, as extra sequences of the engine,
and evicted least recently used past ``max_bytes``. A copy is a fork: it shares the whole KV segments of the
sequence it was taken from (copy-on-write in the engine) and holds only its last, partial segment and its
DeltaNet states privately, so the copies taken every ``snapshot_every`` tokens of one long prompt cost about one
segment each, and the cache counts a shared segment once (``sequences_bytes``).

Why here and not in Rust: where to take a copy is a matter of the chat format (message boundaries) and the
policy may change with the server's scheduler; the engine gives the mechanisms (``fork``,
``copy_sequence``, ``drop_sequence``, ``sequences_bytes``), the cache is a few dozen lines of bookkeeping.

The disk tier (``DiskTier``, ``prefix_cache_dir``) keeps the turn ends (each end-of-prompt entry, the start of
the prompt's last message, and a server request's finished reply) also as safetensors files (the state from
``Engine.export_sequence``, its tokens and logits, a model fingerprint and checksums), bounded in bytes with the
least recently used file deleted first, so a restarted process resumes a long conversation from disk. An entry
that extends a file already written (the conversation's previous turn, or this prompt's last-message start)
stores only its new K/V rows and its DeltaNet states, with a reference to that file, so a conversation's files
take O(n) bytes, not O(n^2). Only the export (a copy in memory) runs on the caller's thread: the checksums, the
encoding and the write (seconds for a long conversation) run on a writer thread, ``max_pending`` entries queued
at most (one more is dropped and counted, not waited for); a process that exits normally, and ``flush()``, wait
for the queue. The snapshots taken every ``snapshot_every`` tokens of a long prefill are written too, as files of
the same chain (each holds the rows since the previous file and its DeltaNet states), so a process killed half way
through a long prefill, or a prompt that shares only part of a long earlier one, resumes from the deepest of them;
one is queued only while no other write is (it is skipped, and counted, when the writer is behind: the next file
then extends the last one written, so every row is still written once), so turn ends keep their ``max_pending``
places. A lookup takes the longest prefix over both tiers; a file read back becomes a memory entry. A file that is
corrupt, truncated, of another model or of another KV dtype, or that extends a file that is missing or broken, is
ignored (logged), never loaded.

The working sequence is the engine's default sequence, so one generation owns it at a time: ``prefill``
gives it to a new generation, and an older one that tries to go on (``decode``) raises
``SequenceEvictedError``. ``turn`` is held by a generation step (and by a whole non-streaming generation)
so that threads sharing a model take turns instead of evicting each other.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy

from lily._lily import Engine, SequenceEvictedError

__all__ = ["CacheInfo", "DiskTier", "PrefixCache", "PrefixReuse", "default_cache_bytes", "model_fingerprint"]

log = logging.getLogger("lily.prefix")

#: Layout tag of a disk entry: a file of another layout is ignored.
DISK_FORMAT = "lily-prefix-2"

#: Tokens between snapshots of a long prefill.
SNAPSHOT_EVERY = 4096


def default_cache_bytes() -> int:
    """A quarter of the memory available now (of physical memory where the system does not say)."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        try:
            free = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
        except (ValueError, OSError, AttributeError):
            free = 8 << 30
    return max(free // 4, 0)


@dataclass(frozen=True)
class CacheInfo:
    """What the prefix cache holds and what it saved."""

    entries: int
    #: Memory the entries hold, a KV segment counted once however many entries (or live sequences) share
    #: it: what ``max_bytes`` bounds.
    bytes: int
    max_bytes: int
    hits: int
    misses: int
    tokens_saved: int
    evictions: int
    #: The disk tier (0 without one): files, their bytes and bound, and entries read back from it.
    disk_entries: int = 0
    disk_bytes: int = 0
    disk_max_bytes: int = 0
    disk_hits: int = 0
    #: Disk writes not made: dropped because ``max_pending`` writes were queued, and failed (logged).
    disk_dropped: int = 0
    disk_write_errors: int = 0
    #: Snapshots of a long prefill not written because another write was queued (the next file covers their rows).
    disk_skipped: int = 0
    #: The entries' states in full (each entry's KV rows and DeltaNet states, shared segments counted in every
    #: entry): what private copies would take; ``logical_bytes - bytes`` is what sharing segments saves.
    logical_bytes: int = 0


class _Entry:
    __slots__ = ("seq", "length", "bytes", "logits", "node")

    def __init__(self, seq: int, length: int, nbytes: int, logits: Any, node: _Node):
        self.seq, self.length, self.bytes, self.logits, self.node = seq, length, nbytes, logits, node


class _Node:
    """A radix-tree node: ``edge`` is the token run from its parent; children by their edge's first token."""

    __slots__ = ("edge", "children", "parent", "entry")

    def __init__(self, edge: tuple[int, ...], parent: _Node | None):
        self.edge = edge
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.entry: _Entry | None = None


def model_fingerprint(checkpoint: str | os.PathLike[str], config: dict[str, Any]) -> str:
    """A hash that tells this model's weights from any other's: the config, and for each safetensors file
    its name, size, header and 16 samples of 4 KiB of its tensor bytes (two random checkpoints of one shape
    have identical headers, so the header alone would not do)."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            n = min(int.from_bytes(fh.read(8), "little"), max(size - 8, 0))
            h.update(fh.read(n))
            data = size - 8 - n
            for i in range(16):
                fh.seek(8 + n + data * i // 16)
                h.update(fh.read(4096))
    return h.hexdigest()


def _checksum(tensors: dict[str, np.ndarray]) -> str:
    """blake2b over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _name(owner: str, tokens: list[int]) -> str:
    """A file's name: models (and KV dtypes) sharing a directory never write each other's files."""
    h = hashlib.sha256(owner.encode())
    h.update(np.asarray(tokens, dtype=np.uint32).tobytes())
    return h.hexdigest()[:40] + ".safetensors"


def _is_row(name: str) -> bool:
    """Whether tensor ``name`` is part of an entry's rows (its tokens and K/V rows: what a child entry uses)."""
    return name == "tokens" or name.endswith((".k", ".v"))


class _DiskEntry:
    """A file of the disk tier: the rows ``start:length`` of a state (its ``own`` tokens, and their K/V rows),
    the rows before them in the ``parent`` entry's file (None: ``start`` is 0), and the state's DeltaNet states
    (and logits) at ``length``."""

    __slots__ = ("path", "start", "length", "own", "parent", "bytes", "has_logits", "rows_checksum")

    def __init__(self, path: Path, start: int, own: np.ndarray, parent: _DiskEntry | None, nbytes: int,
                 has_logits: bool, rows_checksum: str):
        self.path, self.start, self.own, self.parent = path, start, own, parent
        self.length = start + len(own)
        self.bytes, self.has_logits, self.rows_checksum = nbytes, has_logits, rows_checksum

    @property
    def name(self) -> str:
        return self.path.name

    def chain(self) -> list[_DiskEntry]:
        """This entry and its ancestors, the first file (the one from row 0) last."""
        out, e = [], self
        while e is not None:
            out.append(e)
            e = e.parent
        return out

    @property
    def tokens(self) -> list[int]:
        return [int(t) for e in reversed(self.chain()) for t in e.own]


class DiskTier:
    """Prefix-cache entries as safetensors files in ``directory``: at most ``max_bytes`` of this model's
    files (default a quarter of the disk's free space), the least recently used (by mtime, touched on
    every hit, so processes sharing the directory agree) deleted first. Files of other models in the
    directory are left alone and not counted.

    Files are incremental: an entry whose tokens extend those of a file already written or queued (the next turn
    of a conversation) is exported and stored from that parent file's length on, with a reference to it (its name
    and the checksum of its rows), so a conversation of n tokens written at every turn end takes O(n) bytes, not
    O(n^2). A file:
    ``tokens`` (uint32, its own: positions ``start`` to ``position``), the K/V rows of those positions
    (``layers.{i}.k`` / ``.v``), the DeltaNet states at ``position`` (``layers.{i}.conv`` / ``.ssm``, as
    ``Engine.export_sequence`` gives them) and, for an end-of-prompt entry, ``logits``; metadata: the layout tag,
    ``start`` and ``position``, ``parent`` and ``parent_rows`` (the parent's ``rows_checksum``), the KV dtype, the
    model ``fingerprint``, ``rows_checksum`` (of its tokens and K/V rows: what a child uses) and ``checksum`` (of
    the other tensors). Written to a temporary file and renamed, so a crash leaves no partial entry. Loading walks the
    chain from the first file: the entry's file is checked whole and each ancestor's rows (fingerprint, dtype,
    checksums, the link) before anything of it reaches the engine; an entry whose parent is missing, corrupt or
    not the file it was written after is ignored, never loaded. The least recently used file goes first, and
    with it every file written after it (its children): a parent is touched whenever a child is, so the file
    evicted is normally a leaf.

    Writes run on a writer thread (``store`` queues, at most ``max_pending`` entries, and one ``snapshot`` entry
    more, only into an empty queue; ``flush`` waits for them); the index is shared with it under a lock, held only
    for bookkeeping, never during a write."""

    def __init__(self, directory: str | os.PathLike[str], fingerprint: str, kv_dtype: str,
                 max_bytes: int | None = None, max_pending: int = 2):
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.kv_dtype = kv_dtype
        self.max_bytes = shutil.disk_usage(self.dir).free // 4 if max_bytes is None else max_bytes
        self.max_pending = max_pending
        self._files: OrderedDict[str, _DiskEntry] = OrderedDict()  # by file name, least recent first
        self.bytes = 0  # of the files, and of the write in progress (reserved before it starts)
        self.evictions = 0
        self.dropped = 0  # entries not written: the queue was full
        self.skipped = 0  # snapshots not written: a write was queued
        self.write_errors = 0
        self.written = 0  # bytes of the files this object wrote
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when the writer has emptied the queue
        # name, tokens, tensors (K/V rows from the parent's length on), logits, the parent's name and length,
        # whether it is a snapshot
        self._pending: collections.deque[tuple[str, list[int], dict[str, np.ndarray], Any, str, int, bool]] = (
            collections.deque())
        self._writer: threading.Thread | None = None
        self._scan()

    def _scan(self) -> None:
        for tmp in self.dir.glob(".*.tmp"):  # left by a writer that died before its rename
            try:
                pid = int(tmp.name.rsplit(".", 2)[-2])
                os.kill(pid, 0)
            except (ValueError, IndexError, ProcessLookupError):
                tmp.unlink(missing_ok=True)
            except PermissionError:  # a live process of another user
                pass
        heads = {}
        for f in self.dir.glob("*.safetensors"):
            head = self._read_header(f)
            if head is not None:
                heads[f.name] = head
        resolved: dict[str, _DiskEntry | None] = {}

        def resolve(name: str) -> _DiskEntry | None:
            """The entry of file ``name`` with its parents, None when its chain is broken (iterative: a chain
            may be long)."""
            path = []
            while name not in resolved:
                if name not in heads or name in path:  # a missing parent (or a cycle a file could claim)
                    resolved.update(dict.fromkeys(path))
                    return None
                path.append(name)
                name = heads[name][0].get("parent", "")
                if not name:
                    break
            parent = resolved.get(name) if name else None
            for n in reversed(path):
                meta, own, size, has_logits, _ = heads[n]
                start = int(meta.get("start", -1))
                ok = (start == 0 and not meta.get("parent")) or (
                    parent is not None and parent.length == start and parent.rows_checksum == meta.get("parent_rows"))
                parent = _DiskEntry(self.dir / n, start, own, parent, size, has_logits,
                                    str(meta.get("rows_checksum"))) if ok else None
                resolved[n] = parent
            return resolved[path[0]] if path else resolved.get(name)

        for name in sorted(heads, key=lambda n: heads[n][4]):  # by mtime: least recent first
            e = resolve(name)
            if e is None:  # its parent is gone (evicted by another process) or is not the one it extended
                log.info("prefix cache: removing %s: the file it extends is missing or changed", self.dir / name)
                (self.dir / name).unlink(missing_ok=True)
            else:
                self._files[name] = e
                self.bytes += e.bytes

    def _why_not(self, meta: dict[str, str]) -> str | None:
        """Why a file with this metadata cannot be used here (None: it can, once its checksum holds)."""
        if meta.get("format") != DISK_FORMAT:
            return f"not a {DISK_FORMAT} file (format {meta.get('format')!r})"
        if meta.get("fingerprint") != self.fingerprint:
            return "written for another model (fingerprint differs)"
        if meta.get("kv_dtype") != self.kv_dtype:
            return f"its KV rows are {meta.get('kv_dtype')}, this engine's cache is {self.kv_dtype}"
        return None

    def _read_header(self, path: Path) -> tuple[dict[str, str], np.ndarray, int, bool, float] | None:
        """A file's metadata, own tokens, size, whether it has logits, and mtime (None: not usable here)."""
        try:
            st = path.stat()
            with safetensors.safe_open(str(path), "numpy") as f:
                meta = f.metadata() or {}
                why = self._why_not(meta)
                if why is not None:
                    log.debug("prefix cache: ignoring %s: %s", path, why)
                    return None
                own = np.asarray(f.get_tensor("tokens"), dtype=np.uint32)
                has_logits = "logits" in f.keys()  # noqa: SIM118 (safe_open is not a mapping)
            if len(own) != int(meta.get("position", -1)) - int(meta.get("start", -1)):
                raise ValueError(f"{len(own)} tokens for positions {meta.get('start')}..{meta.get('position')}")
            return meta, own, st.st_size, has_logits, st.st_mtime
        except Exception as e:  # noqa: BLE001 (safetensors raises its own errors, and anything may be in a file)
            log.warning("prefix cache: ignoring %s: unreadable (%s)", path, e)
            return None

    def _name(self, tokens: list[int]) -> str:
        return _name(f"{self.fingerprint}:{self.kv_dtype}", tokens)

    def holds(self, tokens: list[int]) -> bool:
        """Whether a file of ``tokens`` is written or queued."""
        name = self._name(tokens)
        with self._lock:
            return name in self._files or any(p[0] == name for p in self._pending)

    def longest(self, tokens: list[int], limit: int) -> _DiskEntry | None:
        """The file with the longest prefix of ``tokens`` of at most ``limit`` tokens (one of all of
        ``tokens`` only if it has logits)."""
        with self._lock:
            files = list(self._files.values())
        return self._longest(files, np.asarray(tokens, dtype=np.int64), limit,
                             lambda e: e.length < len(tokens) or e.has_logits)

    @staticmethod
    def _longest(files: list[_DiskEntry], tokens: np.ndarray, limit: int,
                 usable: Callable[[_DiskEntry], bool]) -> _DiskEntry | None:
        """The longest of ``files`` (at most ``limit`` tokens, ``usable``) whose tokens start ``tokens``; each
        file's own tokens compared once, a parent's result reused by its children."""
        known: dict[str, bool] = {}

        def starts(e: _DiskEntry) -> bool:
            chain = []
            while e is not None and e.name not in known:
                chain.append(e)
                e = e.parent
            ok = True if e is None else known[e.name]
            for c in reversed(chain):
                ok = ok and c.length <= len(tokens) and bool(np.array_equal(tokens[c.start:c.length], c.own))
                known[c.name] = ok
            return ok

        best = None
        for e in files:
            if e.length <= limit and (best is None or e.length > best.length) and usable(e) and starts(e):
                best = e
        return best

    def _read(self, e: _DiskEntry, whole: bool) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """The tensors of ``e``'s file (its rows, checked against ``rows_checksum``, and with ``whole`` the others,
        checked against ``checksum``) and its metadata; ValueError saying why they cannot be used."""
        with safetensors.safe_open(str(e.path), "numpy") as f:
            meta = f.metadata() or {}
            why = self._why_not(meta)
            if why is not None:
                raise ValueError(why)
            tensors = {k: f.get_tensor(k) for k in f.keys() if whole or _is_row(k)}  # noqa: SIM118
        rows = {k: v for k, v in tensors.items() if _is_row(k)}
        rest = {k: v for k, v in tensors.items() if not _is_row(k)}
        if _checksum(rows) != meta.get("rows_checksum") or (whole and _checksum(rest) != meta.get("checksum")):
            raise ValueError("checksum mismatch (the file is corrupt)")
        if meta.get("rows_checksum") != e.rows_checksum:
            raise ValueError("its rows changed since the directory was read")
        if (int(meta.get("start", -1)), meta.get("parent") or None) != (e.start, e.parent and e.parent.name):
            raise ValueError("its place in the chain changed since the directory was read")
        if e.parent is not None and meta.get("parent_rows") != e.parent.rows_checksum:
            raise ValueError("the file it extends is not the one it was written after")
        if not np.array_equal(tensors["tokens"], e.own):
            raise ValueError("its tokens changed since the directory was read")
        return tensors, meta

    def load(self, e: _DiskEntry) -> tuple[list[int], dict[str, np.ndarray], np.ndarray | None] | None:
        """The entry's tokens, state tensors and logits: the rows of every file of its chain, the rest from its
        own, each file checked before it is used; None (logged, and the broken file and the files that extend it
        dropped from the index) when it cannot be used."""
        chain = e.chain()
        rows: dict[str, np.ndarray] = {}
        own: dict[str, np.ndarray] = {}
        for c in reversed(chain):  # from the first file
            try:
                tensors, _ = self._read(c, whole=c is e)
            except Exception as err:  # noqa: BLE001 (a truncated, garbled or missing file raises anything)
                why = str(err) if isinstance(err, ValueError) else f"unreadable ({err})"
                log.warning("prefix cache: ignoring %s%s: %s", c.path,
                            "" if c is e else f" (and {e.path.name}, which extends it)", why)
                self.forget(c)
                return None
            kv = {k: v for k, v in tensors.items() if k.endswith((".k", ".v"))}
            if not rows:
                rows = {k: np.empty((e.length, *v.shape[1:]), v.dtype) for k, v in kv.items()}
            bad = next((k for k, v in kv.items() if k not in rows or v.shape[1:] != rows[k].shape[1:]
                        or v.dtype != rows[k].dtype or len(v) != c.length - c.start), None)
            if bad is not None or kv.keys() != rows.keys():
                log.warning("prefix cache: ignoring %s: its K/V rows (%s) do not continue those of the file it "
                            "extends", c.path, bad or "names")
                self.forget(c)
                return None
            for k, v in kv.items():
                rows[k][c.start:c.length] = v
            if c is e:
                own = {k: v for k, v in tensors.items() if not _is_row(k)}
        with self._lock:
            for c in chain:  # the entry, then its ancestors: a parent stays more recent than its children
                if c.name in self._files:
                    self._files.move_to_end(c.name)
        for c in chain:
            try:
                os.utime(c.path)
            except OSError:
                pass
        logits = own.pop("logits", None)
        return e.tokens, {**rows, **own}, logits

    def store(self, tokens: list[int], export: Callable[[int], tuple[list[int], dict[str, np.ndarray]]],
              logits: np.ndarray | None, snapshot: bool = False) -> bool:
        """Queue a file of the state ``export(first_row)`` gives (its tokens, which must be ``tokens``, and tensors:
        K/V rows from ``first_row`` on), called here only when the entry is queued, with the length of the longest
        file written or queued that ``tokens`` extends (its parent; 0 without one). False when ``max_pending``
        writes are queued already: the entry is dropped and counted (``dropped``), not waited for. An entry held
        or queued already is not written again. The writer thread writes it atomically, evicting the least
        recently used files past ``max_bytes`` (an entry larger than the bound is not written, nor one whose
        parent is gone by then); its errors are logged and counted.

        A ``snapshot`` (one taken every ``snapshot_every`` tokens of a long prefill) is queued only into an empty
        queue, else skipped and counted (``skipped``), not exported: the turn ends keep their ``max_pending``
        places, and the export and write of a snapshot never wait for or delay one. The next file written extends
        the last one before it, so a skipped snapshot's rows are still written, once."""
        name = self._name(tokens)
        with self._lock:
            if name in self._files or any(p[0] == name for p in self._pending):
                return True
            if snapshot and self._pending:
                self.skipped += 1
                log.debug("prefix cache: a disk write is queued; the snapshot at %d tokens is not written",
                          len(tokens))
                return False
            if not snapshot and sum(not p[6] for p in self._pending) >= self.max_pending:
                self.dropped += 1
                log.warning("prefix cache: %d disk writes are queued; an entry of %d tokens is not written",
                            len(self._pending), len(tokens))
                return False
            files = list(self._files.values())
            queued = [(p[0], len(p[1])) for p in self._pending
                      if len(p[1]) < len(tokens) and tokens[:len(p[1])] == p[1]]
        written = self._longest(files, np.asarray(tokens, dtype=np.int64), len(tokens) - 1, lambda e: True)
        parent = max([*queued, *([(written.name, written.length)] if written is not None else [])],
                     key=lambda p: p[1], default=("", 0))
        got, tensors = export(parent[1])
        if got != list(tokens):  # not the state of these tokens: nothing to write
            log.warning("prefix cache: the state of %d tokens was not written: the sequence holds %d others",
                        len(tokens), len(got))
            return False
        with self._lock:
            if name in self._files or any(p[0] == name for p in self._pending):  # queued meanwhile by another thread
                return True
            self._pending.append((name, list(tokens), tensors, logits, *parent, snapshot))
            if self._writer is None:  # not a daemon: a process that exits normally waits for its writes
                self._writer = threading.Thread(target=self._drain, name="lily-prefix-writer")
                self._writer.start()
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the queued writes are done (False if ``timeout`` seconds passed first)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._writer is None, timeout)

    @property
    def pending(self) -> int:
        """Entries queued or being written."""
        with self._lock:
            return len(self._pending)

    def _drain(self) -> None:
        """The writer thread: writes the queued entries in order, then ends."""
        while True:
            with self._lock:
                if not self._pending:
                    self._writer = None
                    self._idle.notify_all()
                    return
                item = self._pending[0]  # stays queued (``holds``) until written
            name, tokens = item[:2]
            try:
                self._write(*item[:6])
            except Exception:  # noqa: BLE001 (the disk tier only saves time: a failed write must not stop the next)
                log.exception("prefix cache: writing an entry of %d tokens failed", len(tokens))
                with self._lock:
                    self.write_errors += 1
            with self._lock:
                self._pending.popleft()

    def _encode(self, tokens: list[int], tensors: dict[str, np.ndarray], logits: Any,
                parent: _DiskEntry | None) -> tuple[bytes, dict[str, str], np.ndarray]:
        """The file of a state of ``tokens`` whose ``tensors`` hold the K/V rows after ``parent``'s: its bytes,
        metadata and own tokens."""
        start = parent.length if parent is not None else 0
        rows = {k: v for k, v in tensors.items() if _is_row(k)}
        rows["tokens"] = np.asarray(tokens[start:], dtype=np.uint32)
        if any(len(v) != len(tokens) - start for v in rows.values()):
            raise ValueError(f"the state to write holds rows other than {start}..{len(tokens)}")
        rest = {k: v for k, v in tensors.items() if not _is_row(k)}
        if logits is not None:
            rest["logits"] = np.asarray(logits, dtype=np.float32)
        meta = {"format": DISK_FORMAT, "start": str(start), "position": str(len(tokens)),
                "parent": parent.name if parent is not None else "",
                "parent_rows": parent.rows_checksum if parent is not None else "", "kv_dtype": self.kv_dtype,
                "fingerprint": self.fingerprint, "rows_checksum": _checksum(rows), "checksum": _checksum(rest)}
        return safetensors.numpy.save({**rows, **rest}, metadata=meta), meta, rows["tokens"]

    def _write(self, name: str, tokens: list[int], tensors: dict[str, np.ndarray], logits: Any, parent_name: str,
               start: int) -> None:
        with self._lock:
            if name in self._files:
                return
            parent = self._files.get(parent_name) if parent_name else None
            if parent_name and (parent is None or parent.length != start):  # its rows before ``start``: in no file
                log.warning("prefix cache: an entry of %d tokens is not written: the file it extends is gone",
                            len(tokens))
                self.dropped += 1
                return
        data, meta, own = self._encode(tokens, tensors, logits, parent)
        if len(data) > self.max_bytes:
            return
        chain = parent.chain() if parent is not None else []
        with self._lock:  # evict, and reserve the bytes, before writing
            if parent is not None and self._files.get(parent.name) is not parent:
                return  # dropped meanwhile (a load found it broken)
            self._touch(chain)  # the chain is evicted last
            while self._files and self.bytes + len(data) > self.max_bytes:
                old = next(iter(self._files.values()))
                if old in chain:  # this file and the chain it extends do not fit together
                    log.warning("prefix cache: an entry of %d tokens is not written: with the files it extends it "
                                "is over the bound of %d bytes", len(tokens), self.max_bytes)
                    self.dropped += 1
                    return
                self._evict(old)
            self.bytes += len(data)
        path = self.dir / name
        fd, tmp_name = tempfile.mkstemp(dir=self.dir, prefix=f".{name}.", suffix=f".{os.getpid()}.tmp")
        tmp = Path(tmp_name)
        try:  # a temporary file renamed when whole: a reader never sees a partial entry
            with open(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as err:
            log.warning("prefix cache: could not write %s: %s", path, err)
            tmp.unlink(missing_ok=True)
            with self._lock:
                self.bytes -= len(data)
                self.write_errors += 1
            return
        with self._lock:
            self.written += len(data)
            if parent is not None and self._files.get(parent.name) is not parent:  # dropped during the write
                self.bytes -= len(data)
                path.unlink(missing_ok=True)
                return
            self._files[name] = _DiskEntry(path, int(meta["start"]), own, parent, len(data), logits is not None,
                                           meta["rows_checksum"])
            self._touch(chain)

    def _touch(self, chain: list[_DiskEntry]) -> None:
        """Make the files of ``chain`` (an entry and its ancestors, in that order) the most recent, ancestors
        last (call with the lock held)."""
        for c in chain:
            if c.name in self._files:
                self._files.move_to_end(c.name)

    def _drop(self, e: _DiskEntry) -> list[_DiskEntry]:
        """Drop ``e`` and the files that extend it from the index, and return them (call with the lock held)."""
        gone = [f for f in self._files.values() if e in f.chain()]
        for f in gone:
            del self._files[f.name]
            self.bytes -= f.bytes
        return gone

    def _evict(self, e: _DiskEntry) -> None:
        """Delete ``e`` and the files that extend it, which cannot be used without it (lock held)."""
        for f in self._drop(e):
            f.path.unlink(missing_ok=True)
            self.evictions += 1

    def forget(self, e: _DiskEntry) -> None:
        """Drop ``e``, a file that cannot be used, and the files that extend it from the index."""
        with self._lock:
            self._drop(e)

    def __len__(self) -> int:
        with self._lock:
            return len(self._files)


class PrefixCache:
    """Copies of an engine's sequences at known token prefixes, at most ``max_bytes`` of them
    (least recently used evicted first; one copy larger than the bound is not kept), and with ``disk`` each
    also as a file there: a lookup that finds a longer prefix on disk than in memory reads it back."""

    def __init__(self, engine: Engine, max_bytes: int | None = None, snapshot_every: int = SNAPSHOT_EVERY,
                 disk: DiskTier | None = None):
        self.engine = engine
        self.disk = disk
        self.max_bytes = default_cache_bytes() if max_bytes is None else max_bytes
        self.snapshot_every = snapshot_every
        self._root = _Node((), None)
        self._lru: OrderedDict[int, _Entry] = OrderedDict()  # by sequence id, least recent first
        self.bytes = 0
        self.hits = self.misses = self.tokens_saved = self.evictions = 0
        self.disk_hits = 0

    def info(self) -> CacheInfo:
        if (d := self.disk) is None:  # (not ``if d``: an empty DiskTier is falsy)
            disk = (0, 0, 0, 0, 0, 0)
        else:
            disk = (len(d), d.bytes, d.max_bytes, d.dropped, d.write_errors, d.skipped)
        logical = sum(e.bytes for e in self._lru.values())
        return CacheInfo(len(self._lru), self.bytes, self.max_bytes, self.hits, self.misses, self.tokens_saved,
                         self.evictions, *disk[:3], self.disk_hits, *disk[3:], logical_bytes=logical)

    def longest(self, tokens: list[int], limit: int) -> _Entry | None:
        """The entry with the longest prefix of ``tokens`` of at most ``limit`` tokens (one of exactly
        ``len(tokens)`` only if it kept its logits)."""
        node, i, best = self._root, 0, None
        while True:
            e = node.entry
            if e is not None and e.length <= limit and (e.length < len(tokens) or e.logits is not None):
                best = e
            if i >= len(tokens):
                break
            child = node.children.get(tokens[i])
            if child is None or tuple(tokens[i:i + len(child.edge)]) != child.edge:
                break
            node, i = child, i + len(child.edge)
        while self.disk is not None:
            on_disk = self.disk.longest(tokens, limit)
            if on_disk is None or (best is not None and on_disk.length <= best.length):
                break
            loaded = self._from_disk(on_disk)
            if loaded is not None:
                best = loaded
                break
        if best is not None:
            self._lru.move_to_end(best.seq)
        return best

    def record(self, reused: int) -> None:
        """Count a prompt that resumed ``reused`` tokens (0: a miss)."""
        if reused:
            self.hits += 1
            self.tokens_saved += reused
        else:
            self.misses += 1

    def cuts(self, tokens: list[int], start: int, boundary_id: int | None) -> list[int]:
        """Where a prefill of ``tokens`` from ``start`` keeps copies (``keep_cut``; before the end of the prompt, which
        is kept too): every ``snapshot_every`` tokens and the start of the last message (``last_message``)."""
        n, every = len(tokens), self.snapshot_every
        cuts = set(range((start // every + 1) * every, n, every)) if every > 0 else set()
        cut = self.last_message(tokens, start, boundary_id)
        if cut is not None:
            cuts.add(cut)
        return sorted(cuts)

    @staticmethod
    def last_message(tokens: list[int], start: int, boundary_id: int | None) -> int | None:
        """The start of the last message of ``tokens`` (its ``boundary_id``) after ``start``, if there is one. Its
        copy is also written to the disk tier (``persist``): it is what the next turn's prompt shares when the
        chat template renders the history differently from the prompt it sent (Qwen's drops the reasoning of
        earlier turns once a new user message comes), so the next turn's files extend it."""
        if boundary_id is None:
            return None
        return next((i for i in range(len(tokens) - 1, start, -1) if tokens[i] == boundary_id), None)

    def _from_disk(self, on_disk: _DiskEntry) -> _Entry | None:
        """A memory entry made from a disk file (None if the file or its state cannot be used). It is
        the most recent entry, so the bound evicts others first; alone over the bound, it goes with the
        next ``add``."""
        assert self.disk is not None
        got = self.disk.load(on_disk)
        if got is None:
            return None
        tokens, tensors, logits = got
        seq = self.engine.new_sequence()
        try:
            self.engine.import_sequence(tokens, self.disk.kv_dtype, tensors, seq=seq)
        except (ValueError, TypeError) as err:
            self.engine.drop_sequence(seq)
            log.warning("prefix cache: ignoring %s: its state does not fit this engine (%s)", on_disk.path, err)
            self.disk.forget(on_disk)
            return None
        except BaseException:  # a device error, an interrupt: not the file's fault, but free the sequence
            self.engine.drop_sequence(seq)
            raise
        node = self._insert(tokens)
        if node.entry is not None:  # held in memory too, but not found above: keep the memory copy
            self.engine.drop_sequence(seq)
            return node.entry
        e = _Entry(seq, len(tokens), self.engine.sequence_bytes(seq), logits, node)
        node.entry = e
        self._lru[seq] = e
        self._count()
        while self.bytes > self.max_bytes and next(iter(self._lru.values())) is not e:
            self._evict(next(iter(self._lru.values())))
        self.disk_hits += 1
        return e

    def holds(self, tokens: list[int]) -> bool:
        node = self._find(tokens)
        return node is not None and node.entry is not None

    def keep_cut(self, tokens: list[int], seq: int, last: int | None) -> None:
        """Keep a copy of sequence ``seq`` at a cut of its prefill (``cuts``; ``tokens`` are its tokens) unless one
        is held, and a file of it: the start of the last message (``last``) as a turn end, the others as snapshots
        (``DiskTier.store``: written when no other write is queued)."""
        if not self.holds(tokens):
            self.add(tokens, seq, persist=True, snapshot=len(tokens) != last)

    def add(self, tokens: list[int], seq: int, logits: Any = None, persist: bool | None = None,
            snapshot: bool = False) -> None:
        """Keep a copy of sequence ``seq`` (whose tokens are ``tokens``) as a new entry, and with ``persist``
        (default: for an end-of-prompt entry, the one that has its ``logits``; the callers also persist the cuts of
        a prefill, ``keep_cut``, and a finished reply) a file of it in the disk tier, as a ``snapshot`` of a long
        prefill (``DiskTier.store``) or a turn end."""
        persist = logits is not None if persist is None else persist
        if persist and self.disk is not None:
            def export(first_row: int) -> tuple[list[int], dict[str, np.ndarray]]:
                got, _, tensors = self.engine.export_sequence(seq, first_row=first_row)
                return got, tensors

            self.disk.store(tokens, export, logits, snapshot=snapshot)
        node = self._insert(tokens)
        if node.entry is not None:  # the same prefix again: keep the newer logits, touch it
            if logits is not None:
                node.entry.logits = logits
            self._lru.move_to_end(node.entry.seq)
            return
        copy = self.engine.fork(seq)
        e = _Entry(copy, len(tokens), self.engine.sequence_bytes(copy), logits, node)
        node.entry = e
        self._lru[copy] = e
        self._count()
        while self.bytes > self.max_bytes and self._lru:
            self._evict(next(iter(self._lru.values())))

    def resume(self, entry: _Entry, seq: int) -> None:
        """Sequence ``seq`` becomes the entry's copy."""
        self.engine.copy_sequence(entry.seq, seq)

    def clear(self) -> None:
        for e in list(self._lru.values()):
            self._evict(e, counted=False)

    def _evict(self, e: _Entry, counted: bool = True) -> None:
        del self._lru[e.seq]
        self.evictions += counted
        self.engine.drop_sequence(e.seq)
        self._count()
        node = e.node
        node.entry = None
        # Prune what no entry needs any more: empty leaves, then merge a lone child into its parent.
        while node.parent is not None and node.entry is None and not node.children:
            parent = node.parent
            del parent.children[node.edge[0]]
            node = parent
        if node.parent is not None and node.entry is None and len(node.children) == 1:
            (child,) = node.children.values()
            child.edge = node.edge + child.edge
            child.parent = node.parent
            node.parent.children[node.edge[0]] = child

    def _count(self) -> None:
        """``bytes`` = what the entries hold together: entries forked from one conversation share its whole KV
        segments, so the sum of their sizes would count those again for each (evicting one of them frees only
        what it alone holds)."""
        self.bytes = self.engine.sequences_bytes(list(self._lru))

    def _find(self, tokens: list[int]) -> _Node | None:
        node, i = self._root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None or tuple(tokens[i:i + len(child.edge)]) != child.edge:
                return None
            node, i = child, i + len(child.edge)
        return node if i == len(tokens) else None

    def _insert(self, tokens: list[int]) -> _Node:
        node, i = self._root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(tuple(tokens[i:]), node)
                node.children[tokens[i]] = leaf
                return leaf
            k = 0
            edge = child.edge
            while k < len(edge) and i + k < len(tokens) and edge[k] == tokens[i + k]:
                k += 1
            if k < len(edge):  # split the edge at k
                mid = _Node(edge[:k], node)
                node.children[tokens[i]] = mid
                child.edge, child.parent = edge[k:], mid
                mid.children[child.edge[0]] = child
                child = mid
            node, i = child, i + k
        return node


class PrefixReuse:
    """Prefills the engine's default sequence, resuming the longest cached prefix of the prompt (from the
    sequence itself when it already holds one, else from ``cache``). Knows which generation owns it."""

    def __init__(self, engine: Engine, boundary_id: int | None, cache: PrefixCache | None = None):
        self.engine = engine
        self.boundary_id = boundary_id  # the token a message starts with: where snapshots are taken
        self.cache = cache if cache is not None else PrefixCache(engine)
        self.turn = threading.RLock()
        self._owner: object | None = None  # the ticket of the generation that owns the sequence
        self._position = 0  # the engine's position after this object's last call on it

    def reset(self) -> None:
        """Empty the engine's sequence and forget the saved prefixes (a running generation is evicted)."""
        with self.turn:
            self._owner = None
            self.engine.reset()
            self.cache.clear()

    def prefill(self, tokens: list[int], ticket: object | None = None) -> tuple[Any, int]:
        """Logits after ``tokens``, and how many leading tokens were reused rather than computed. The sequence
        now belongs to ``ticket`` (the previous owner's next ``decode`` raises)."""
        with self.turn:
            self._owner = ticket
            try:
                return self._prefill(tokens)
            finally:
                self._position = self.engine.position

    def decode(self, ticket: object, token: int) -> Any:
        """The logits after ``token``, appended to the sequence of generation ``ticket``; raises
        ``SequenceEvictedError`` if the sequence is no longer that generation's."""
        with self.turn:
            if self._owner is not ticket:
                raise SequenceEvictedError(
                    "this generation's sequence was taken over by a later generation (or reset) on the same model: "
                    "a Model holds one sequence, so finish or close a stream before starting another on it, or "
                    "load a second Model")
            if self.engine.position != self._position:
                raise SequenceEvictedError(
                    f"the engine's sequence changed under this generation (position {self.engine.position}, expected "
                    f"{self._position}): model.engine was used directly while the generation was running")
            try:
                return self.engine.decode(token)
            finally:
                self._position = self.engine.position

    def _prefill(self, tokens: list[int]) -> tuple[Any, int]:
        eng, cache = self.engine, self.cache
        n = len(tokens)
        # The sequence itself continues when it holds a prefix (at most n - 1 tokens: the last one must run
        # to give the logits), unless the cache has a longer one.
        own = eng.position if 0 < eng.position <= min(eng.cached_prefix(tokens), n - 1) else 0
        entry = cache.longest(tokens, n)
        if entry is not None and entry.length > own:
            cache.resume(entry, 0)
            start = entry.length
        elif own:
            start = own
        else:
            eng.reset()
            start = 0
        cache.record(start)
        if start == n:  # the identical prompt again: its end-of-prompt state and logits
            assert entry is not None
            return entry.logits.copy(), start
        pos = start
        last = cache.last_message(tokens, start, self.boundary_id)
        for cut in cache.cuts(tokens, start, self.boundary_id):
            eng.prefill(tokens[pos:cut])
            pos = cut
            cache.keep_cut(tokens[:cut], 0, last)
        logits = eng.prefill(tokens[pos:])
        cache.add(list(tokens), 0, logits.copy())
        return logits, start
