"""``lily bench --compare llama.cpp``: llama.cpp's ``llama-bench`` on a GGUF of the checkpoint's shapes
(``lily.bench.gguf``), at the prompt lengths, depths and thread count Lily runs, so the ratios come from one run.

Per round, two ``llama-bench`` calls, each test with its own warm-up run: ``-p L -n 0`` (prefill of L tokens
from an empty context: Lily's prefill tok/s) and ``-p 0 -n STEPS -d L`` (STEPS tokens decoded after a context
of L: Lily's decode tok/s over the steps after an L-token prompt). ``lily.bench.depth`` uses the same calls."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from lily.bench.gguf import write_gguf
from lily.command import CommandError

__all__ = ["GgufFile", "find_llama_bench", "llama_bench", "llama_bench_records"]


def find_llama_bench(path: str | None) -> Path:
    """The ``llama-bench`` binary: ``path`` if given, else the one on PATH."""
    found = path if path else shutil.which("llama-bench")
    if not found:
        raise CommandError("--compare llama.cpp needs a llama-bench binary: pass --llama-bench PATH or put it on PATH")
    p = Path(found)
    if not p.is_file():
        raise CommandError(f"--llama-bench {found}: no such file")
    return p


class GgufFile:
    """The GGUF llama.cpp runs: ``path`` if it exists, else written there from ``cfg`` (and kept); with no path, a
    temporary file removed on ``close``."""

    def __init__(self, cfg: dict, path: str | None, seed: int, say=None):
        self.tmp = None
        if path and Path(path).is_file():
            self.path = Path(path)
            return
        if path:
            self.path = Path(path)
        else:
            self.tmp = tempfile.TemporaryDirectory(prefix="lily-bench-")
            self.path = Path(self.tmp.name) / "model.gguf"
        if say:
            say(f"lily bench: writing {self.path} (random weights of the checkpoint's shapes, Q4_0) for llama.cpp")
        write_gguf(cfg, self.path, seed)

    def close(self) -> None:
        if self.tmp is not None:
            self.tmp.cleanup()
            self.tmp = None


def _run(cmd: list[str], timeout: float | None) -> list[dict]:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CommandError(f"llama-bench timed out after {timeout:.0f} s") from None
    except OSError as e:
        raise CommandError(f"{cmd[0]}: cannot run ({e})") from None
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise CommandError(f"llama-bench failed (exit {done.returncode}): {tail}")
    try:
        tests = json.loads(done.stdout)
    except ValueError:
        raise CommandError("llama-bench printed no JSON (a build without -o json?)") from None
    if not isinstance(tests, list) or not tests or not all("avg_ts" in t for t in tests):
        raise CommandError("llama-bench's JSON lacks the tests' avg_ts")
    return tests


def llama_bench(binary: Path, gguf: Path, lengths: list[int], steps: int, threads: int, reps: int = 1,
                timeout: float | None = None) -> dict[int, dict]:
    """{length: {"prefill_tok_s", "decode_tok_s", "backend"}}: a prefill of each length from an empty context
    (``-p L -n 0``) and ``steps`` tokens decoded after a context of that length (``-p 0 -n STEPS -d L``), each
    the mean of ``reps`` repetitions after llama-bench's own warm-up; two calls for all lengths."""
    ls = ",".join(str(n) for n in lengths)
    base = [str(binary), "-m", str(gguf), "-t", str(threads), "-r", str(reps), "-o", "json"]
    out: dict[int, dict] = {n: {} for n in lengths}
    for t in _run(base + ["-p", ls, "-n", "0"], timeout):
        out.setdefault(int(t["n_prompt"]), {})["prefill_tok_s"] = float(t["avg_ts"])
        out[int(t["n_prompt"])]["backend"] = f"llama.cpp {t.get('backends', '?')} {t.get('build_commit', '')}".strip()
    for t in _run(base + ["-p", "0", "-n", str(steps), "-d", ls], timeout):
        out.setdefault(int(t.get("n_depth", 0)), {})["decode_tok_s"] = float(t["avg_ts"])
    return out


def llama_bench_records(binary: Path, gguf: Path, lengths: list[int], steps: int, threads: int,
                        timeout: float | None = None) -> list[dict]:
    """One record per prompt length in the form of Lily's workers (prefill and decode tok/s)."""
    got = llama_bench(binary, gguf, lengths, steps, threads, timeout=timeout)
    if any("prefill_tok_s" not in got[n] or "decode_tok_s" not in got[n] for n in lengths):
        raise CommandError(f"llama-bench reported no result for some of the lengths {lengths}")
    return [{"prompt_tokens": n, "prefill_tok_s": got[n]["prefill_tok_s"], "decode_tok_s": got[n]["decode_tok_s"],
             "peak_memory_bytes": None, "backend": got[n]["backend"]} for n in lengths]
