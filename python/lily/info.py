"""``lily.info()`` and ``lily info``: what this machine gives Lily, for a bug report.

The version, the operating system, the backend ``"auto"`` picks and why, the Metal GPU (name, GPU family,
``recommendedMaxWorkingSetSize``, unified memory) or why there is none, and, given a checkpoint, whether it fits
the backend's memory at the requested ``max_seq`` (the check loading makes, without loading)::

    $ lily info ./Qwen3.6-35B-A3B-4bit --max-seq 32768
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from lily import _lily
from lily.arguments import integer
from lily.command import MAX_SEQ, ArgParser, CommandError, run
from lily.loading import BACKENDS, KV_DTYPES

__all__ = ["build_parser", "format_info", "info", "main"]


def info(
    checkpoint: str | os.PathLike[str] | None = None,
    *,
    backend: str = "auto",
    max_seq: int | None = None,
    kv_dtype: str = "bf16",
) -> dict[str, Any]:
    """This machine as Lily sees it (``lily._lily.system_info``), and with ``checkpoint`` (a local folder) a
    ``"checkpoint"`` entry: whether it fits ``backend``'s memory at ``max_seq`` (``lily._lily.checkpoint_fit``).
    Builds no backend."""
    out: dict[str, Any] = dict(_lily.system_info())
    if checkpoint is not None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
        if max_seq is not None:
            integer("max_seq", max_seq, low=1, high=2**32 - 1)
        fit = _lily.checkpoint_fit(os.fspath(checkpoint), backend=backend, max_seq=max_seq, kv_dtype=kv_dtype)
        out["checkpoint"] = {"path": os.fspath(checkpoint), "requested_max_seq": max_seq, **fit}
    return out


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 10**8 else f"{n / 1e6:.2f} MB"


def format_info(report: dict[str, Any]) -> str:
    """``info()``'s report as the lines ``lily info`` prints."""
    lines = [
        f"lily {report['version']}",
        f"OS: {report['os']}",
        f"backend \"auto\": {report['auto']['backend']} ({report['auto']['reason']})"
        + (" [a fallback: no usable GPU]" if report["auto"]["fallback"] else ""),
    ]
    metal = report["metal"]
    if "device" in metal:
        lines += [
            f"Metal device: {metal['device']}",
            f"  GPU family: {metal['gpu_family']}",
            f"  recommendedMaxWorkingSetSize: {_gb(metal['recommended_max_working_set_size'])}",
            f"  unified memory: {'yes' if metal['unified_memory'] else 'no'}",
            f"  largest buffer: {_gb(metal['max_buffer_length'])}",
        ]
    else:
        lines.append(f"Metal: none ({metal['error']})")
    ckpt = report.get("checkpoint")
    if ckpt is not None:
        asked = ckpt["requested_max_seq"]
        lines.append(f"checkpoint: {ckpt['path']} on {ckpt['backend']}"
                     + (f" at max_seq {asked:,}" if asked is not None else ""))
        if ckpt["limit"] is not None:
            limit = f"limit {_gb(ckpt['limit'])} ({ckpt['limit_is']})"
        elif ckpt["backend"].startswith("cpu"):
            limit = "no memory limit checked (the CPU backend: the operating system pages)"
        else:
            limit = "no memory limit checked (the simulator plays a GPU of any size: LILY_METAL_SIM_WORKING_SET)"
        lines.append(f"  {limit}")
        if ckpt["fits"]:
            lines.append(f"  fits at max_seq {ckpt['max_seq']:,}: {ckpt['describe']}")
            if ckpt["note"]:
                lines.append(f"  {ckpt['note']}")
        else:
            lines.append(f"  DOES NOT FIT: {ckpt['error']}")
    return "\n".join(lines)


def build_parser() -> ArgParser:
    ap = ArgParser(prog="lily info", description="What this machine gives Lily (version, OS, the backend \"auto\" "
                   "picks and why, the Metal GPU), and whether a checkpoint fits: paste it into a bug report.")
    ap.add_argument("checkpoint", nargs="?", default=None,
                    help="a checkpoint folder: whether it fits the backend's memory at --max-seq")
    ap.add_argument("--backend", choices=BACKENDS, default="auto", help="the backend to check the checkpoint on")
    ap.add_argument("--max-seq", type=MAX_SEQ, default=None,
                    help="context length to check (default: the model's, fitted to the device)")
    ap.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16", help="element type of the KV cache")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run("lily info", lambda: _print(args))


def _print(args: argparse.Namespace) -> int:
    if args.checkpoint is not None and not os.path.isdir(args.checkpoint):
        raise CommandError(f"{args.checkpoint}: not a checkpoint folder")
    report = info(args.checkpoint, backend=args.backend, max_seq=args.max_seq, kv_dtype=args.kv_dtype)
    print(format_info(report))
    ckpt = report.get("checkpoint")
    return 1 if ckpt is not None and not ckpt["fits"] else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
