"""``lily bench``'s command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lily import command
from lily.bench.protocol import parse_concurrency, parse_lengths, run_bench
from lily.bench.workers import run_worker
from lily.command import ArgParser, CommandError
from lily.loading import BACKENDS, KV_DTYPES, PRECISIONS

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    ap = ArgParser(prog="lily bench", description="Prefill / decode speed of a checkpoint, batch 1 "
                   "(--concurrency: batched decode of several sequences).")
    ap.add_argument("model", help="checkpoint folder (MLX 4-bit or HF bf16)")
    ap.add_argument("--lengths", type=_lengths, default=None,
                    help="comma-separated prompt lengths, K suffix allowed (default 256,512,...,128K, cut to "
                         "what fits max_seq and memory)")
    ap.add_argument("--backend", default="auto", choices=BACKENDS, help="Lily's compute backend")
    ap.add_argument("--max-seq", type=command.MAX_SEQ, default=None, help="engine max_seq (default: the config's)")
    ap.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16",
                    help="element type of Lily's stored keys and values (default bf16)")
    ap.add_argument("--precision", choices=PRECISIONS, default="exact",
                    help="Lily's CPU 4-bit matmuls: exact (default, fp32) or fast (activations as int8)")
    ap.add_argument("--decode-steps", type=command.integer(1), default=64,
                    help="decode steps timed after the first token (64)")
    ap.add_argument("--warmup-steps", type=command.integer(0), default=2, help="decode steps of the warm-up run (2)")
    ap.add_argument("--rounds", type=command.integer(1), default=2, help="rounds, alternating order (2)")
    ap.add_argument("--seed", type=command.integer(0), default=0, help="seed of the synthetic prompt ids")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the records as JSON")
    ap.add_argument("--plot", nargs="?", const="bench.png", default=None, metavar="PNG",
                    help="write a PNG of tok/s against context length (default bench.png; needs matplotlib)")
    ap.add_argument("--compare", choices=("mlx-lm", "llama.cpp"), default=None,
                    help="also run MLX-LM's own generation path on the same checkpoint, or llama.cpp's llama-bench "
                         "on a random-weight GGUF of its shapes at the same bytes per weight, and print the ratios")
    ap.add_argument("--llama-bench", default=None, metavar="PATH",
                    help="llama.cpp's llama-bench binary for --compare llama.cpp (default: the one on PATH)")
    ap.add_argument("--gguf", default=None, metavar="PATH",
                    help="--compare llama.cpp: the GGUF to run (written there first if absent, then kept; "
                         "default: a temporary file)")
    ap.add_argument("--threads", type=command.integer(1), default=None,
                    help="compute threads of both engines (LILY_THREADS, llama-bench -t; default: the usable CPUs)")
    ap.add_argument("--mlx-dtype", choices=("auto", "native", "float32"), default="auto",
                    help="MLX-LM run as saved (native) or with every float tensor upcast to fp32; auto: fp32 on a "
                         "CPU (its bf16 CPU path is ~8x slower), as saved on a GPU")
    ap.add_argument("--engine", choices=("lily", "mlx-lm"), default="lily", help=argparse.SUPPRESS)
    ap.add_argument("--same-process", action="store_true",
                    help="one process per round instead of a fresh process per measurement")
    ap.add_argument("--bandwidth-mib", type=command.integer(1), default=1024,
                    help="buffer size of the bandwidth test (1024)")
    ap.add_argument("--bandwidth-method", choices=("auto", "numpy", "mlx"), default="auto",
                    help="how the memory bandwidth is measured (auto: MLX on the GPU for --backend metal, else numpy)")
    ap.add_argument("--timeout", type=command.number(0), default=None, help="seconds per worker process")
    ap.add_argument("--concurrency", type=_concurrency, default=None, metavar="N,N,...",
                    help="measure batched decode instead: that many sequences decoded together per level (e.g. "
                         "1,2,4,8), aggregate and per-sequence decode tok/s")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        run_worker(json.loads(argv[1]))
        return 0
    args = build_parser().parse_args(argv)
    return command.run("lily bench", lambda: _bench(args))


def _lengths(text: str) -> list[int]:
    try:
        return parse_lengths(text)
    except CommandError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _concurrency(text: str) -> list[int]:
    try:
        return parse_concurrency(text)
    except CommandError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _bench(args) -> int:
    if args.compare and args.compare == args.engine:
        raise CommandError("--compare names the engine being measured")
    if not Path(args.model).is_dir():
        raise CommandError(f"{args.model}: not a folder")
    return run_bench(args)
