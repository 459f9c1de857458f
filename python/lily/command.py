"""What every ``lily`` subcommand shares: its argument parser and the one error path.

A command reports a problem as one line on stderr, ``lily CMD: error: MESSAGE``, and exits with 2 for bad
input (an option value, a file or folder that does not fit: ``CommandError`` and argparse's errors) or 1 when
the work itself failed (a ``LilyError`` from the engine, an ``OSError``, a value the library refused);
Ctrl-C exits with 130. No traceback reaches the user.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from lily._lily import LilyError

__all__ = ["MAX_SEQ", "PORT", "ArgParser", "CommandError", "integer", "number", "run", "worker_env"]


class CommandError(Exception):
    """What was asked for cannot be done; the message says why, and what to do where that helps."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


class ArgParser(argparse.ArgumentParser):
    """argparse with a one-line error instead of usage + error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _bounds(low, high) -> str:
    return "" if low is None and high is None else (
        f" >= {low}" if high is None else f" <= {high}" if low is None else f" from {low} to {high}")


def integer(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer within ``[low, high]``, checked when the command line is read."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected an integer{_bounds(low, high)}, got {text!r}")
        return value

    return parse


def number(low: float | None = None, high: float | None = None) -> Callable[[str], float]:
    """An argparse ``type``: a finite number within ``[low, high]``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected a number{_bounds(low, high)}, got {text!r}")
        return value

    return parse


#: a TCP port (0: any free one)
PORT = integer(0, 65535)
#: a context length the engine can hold (positions reach the kernels as 32-bit integers)
MAX_SEQ = integer(1, 2**32 - 1)


def prefix_cache_args(p: argparse.ArgumentParser) -> None:
    """The prefix cache's disk tier flags (``lily chat``, ``lily serve``)."""
    p.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                   help="also keep the prefix cache's entries as files in DIR: a later run resumes from them")
    p.add_argument("--prefix-cache-dir-bytes", type=integer(0), default=None, metavar="BYTES",
                   help="bound of --prefix-cache-dir (default: a quarter of the disk's free space)")
    p.add_argument("--prefix-cache-snapshot-every", type=integer(0), default=None, metavar="TOKENS",
                   help="tokens between the prefix cache's copies inside a long prefill, written to "
                        "--prefix-cache-dir too (default 4096; 0: none)")


def run(prog: str, body: Callable[[], int | None]) -> int:
    """``body()``'s exit status, or the one-line report of what it raised."""
    try:
        return body() or 0
    except CommandError as e:
        return _report(prog, e, e.code)
    except BrokenPipeError:  # the reader went away (`lily generate ... | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second one when Python flushes
        return 0
    except (LilyError, ValueError, TypeError, OSError) as e:
        return _report(prog, e, 1)
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130


def worker_env() -> dict[str, str]:
    """The environment of a worker process (``python -m lily.bench --worker ...``): this one's, with the folder
    lily is imported from first on ``PYTHONPATH``, so the worker runs the same lily."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _report(prog: str, error: BaseException, code: int) -> int:
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    print(f"{prog}: error: {first}", file=sys.stderr)
    return code
