"""The ``lily`` command: ``generate``, ``chat``, and ``info`` / ``synth`` / ``bench`` / ``eval`` / ``serve`` (own
modules).

    lily generate MODEL "prompt"      stream an answer (chat template applied; --raw to skip it)
    lily chat MODEL                   interactive chat: /reset clears the history, /exit quits

Errors (a missing model, a bad flag value) print one line, ``lily generate: error: ...``, and exit 1 or 2
(``lily.command``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from lily import command
from lily.arguments import strings
from lily.command import ArgParser, CommandError
from lily.loading import BACKENDS, KV_DTYPES, PRECISIONS, load
from lily.model import DEFAULT_MAX_TOKENS
from lily.sampling import Sampler

__all__ = ["main"]

_DISPATCH = {"info": "lily.info", "synth": "lily.synth", "bench": "lily.bench", "eval": "lily.eval",
             "serve": "lily.server"}
DIM, RESET = "\x1b[2m", "\x1b[0m"


def _bias(text: str) -> tuple[int, float]:
    try:
        token, value = text.split("=", 1)
        return int(token), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS, got {text!r}") from None


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint folder or Hugging Face repo id (e.g. mlx-community/Qwen3.6-35B-A3B-4bit)")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="compute backend")
    p.add_argument("--max-seq", type=command.MAX_SEQ, default=None, help="context length (default: the engine's)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16",
                   help="element type of the stored keys and values (default bf16; f32 doubles the KV memory)")
    p.add_argument("--precision", choices=PRECISIONS, default="exact",
                   help="CPU 4-bit matmuls: exact (default, fp32) or fast (activations as int8: faster, "
                        "a little below bf16 accuracy)")
    command.prefix_cache_args(p)
    p.add_argument("--max-tokens", type=command.integer(1), default=None,
                   help=f"tokens to generate at most per reply (default {DEFAULT_MAX_TOKENS})")
    s = p.add_argument_group("sampling (defaults: the checkpoint's generation_config.json)")
    s.add_argument("--temperature", "--temp", type=command.number(0), default=None, help="0 = greedy")
    s.add_argument("--top-k", type=command.integer(0), default=None, help="0 = off")
    s.add_argument("--top-p", type=command.number(0, 1), default=None, help="1 = off")
    s.add_argument("--min-p", type=command.number(0, 1), default=None, help="0 = off")
    s.add_argument("--repetition-penalty", type=command.number(), default=None,
                   help="> 1 makes tokens of the prompt and the reply less likely (1 = off)")
    s.add_argument("--presence-penalty", type=command.number(), default=None,
                   help="subtracted from the logit of every token already generated (0 = off)")
    s.add_argument("--frequency-penalty", type=command.number(), default=None,
                   help="subtracted once per earlier occurrence of a generated token (0 = off)")
    s.add_argument("--logit-bias", type=_bias, action="append", default=None, metavar="ID=BIAS",
                   help="add BIAS to the logit of token ID")
    s.add_argument("--seed", type=command.integer(0, 2**64 - 1), default=None, help="same seed, same tokens")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--no-think", action="store_true", help="thinking off (enable_thinking=False)")
    p.add_argument("--hide-think", action="store_true",
                   help="think, but show only a one-line count of the thinking (on stderr)")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--no-stats", action="store_true", help="do not print the timing line")
    p.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                   help="dim the thinking (auto: when standard output is a terminal)")


def _parser() -> ArgParser:
    p = ArgParser(prog="lily", description="Fast local inference for Qwen3.6-35B-A3B.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgParser)
    g = sub.add_parser("generate", help="generate from a prompt, streaming to the terminal")
    _add_common(g)
    g.add_argument("prompt", help="the prompt ('-' reads standard input)")
    g.add_argument("--raw", action="store_true", help="use the prompt as is, without the chat template")
    c = sub.add_parser("chat", help="interactive chat (/reset, /exit)")
    _add_common(c)
    for name in _DISPATCH:
        sub.add_parser(name, help=f"see `lily {name} --help`", add_help=False)
    return p


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    out = {
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "seed": args.seed,
    }
    if args.logit_bias:
        out["logit_bias"] = dict(args.logit_bias)
    return {k: v for k, v in out.items() if v is not None}


class _Printer:
    """Writes a reply as it streams: the thinking under a "thinking:" header (dimmed in colour), or, with
    --hide-think, a one-line count of it on stderr (updated in place on a terminal); then the answer. A reply
    that ends before any answer says so."""

    def __init__(self, out: TextIO, color: bool, show_thinking: bool, err: TextIO | None = None):
        self.out, self.color, self.show_thinking = out, color, show_thinking
        self.err = err or sys.stderr
        self.live = self.err.isatty()
        self.in_thinking = False
        self.thinking_tokens = 0
        self.thought = self.answered = False
        self.t0 = time.perf_counter()

    def _dim(self, text: str) -> str:
        return f"{DIM}{text}{RESET}" if self.color else text

    def chunk(self, reasoning: str, content: str) -> None:
        """One token's share of the reply."""
        if reasoning or (self.in_thinking and not content):
            self._thinking(reasoning)
        if content:
            self._end_thinking()
            self.answered = True
            self.out.write(content)
            self.out.flush()

    def _thinking(self, text: str) -> None:
        if not self.in_thinking:
            self.in_thinking = self.thought = True
            self.t0 = time.perf_counter()
            if self.show_thinking:
                self.out.write(self._dim("thinking:") + "\n" + (DIM if self.color else ""))
        self.thinking_tokens += 1
        if self.show_thinking:
            self.out.write(text)
            self.out.flush()
        elif self.live:
            self.err.write(f"\r{self._dim(f'thinking: {self.thinking_tokens} tokens...')}")
            self.err.flush()

    def _end_thinking(self) -> None:
        if not self.in_thinking:
            return
        self.in_thinking = False
        if self.show_thinking:
            self.out.write((RESET if self.color else "") + "\n\n")
        else:
            seconds = time.perf_counter() - self.t0
            line = f"thinking: {self.thinking_tokens} tokens, {seconds:.1f} s (hidden)"
            self.err.write(("\r\x1b[K" if self.live else "") + self._dim(line) + "\n")
            self.err.flush()

    def finish(self, finish_reason: str | None = None, max_tokens: int | None = None) -> None:
        self._end_thinking()
        if self.answered or self.show_thinking:
            self.out.write("\n")
        self.out.flush()
        if self.thought and not self.answered:
            why = (f"it reached --max-tokens {max_tokens} while thinking; raise --max-tokens, or --no-think"
                   if finish_reason == "length" else "the model ended its turn while thinking")
            self.err.write(f"[no answer: {why}]\n")
            self.err.flush()


def _use_color(choice: str, stream: TextIO) -> bool:
    if choice == "auto":
        return stream.isatty()
    return choice == "always"


def _stats_line(stats, finish: str | None) -> str:
    return f"[{stats} | finish: {finish}]"


def _run_chat_turn(model, messages, args, printer: _Printer):
    message = None
    for chunk in model.chat(
        messages,
        enable_thinking=not args.no_think,
        stream=True,
        max_tokens=args.max_tokens,
        stop=args.stop,
        **_sampling(args),
    ):
        printer.chunk(chunk.reasoning, chunk.content)
        if chunk.message is not None:
            message = chunk.message
    printer.finish(message.finish_reason if message is not None else None, args.max_tokens or DEFAULT_MAX_TOKENS)
    if message is not None and message.tool_calls:
        for call in message.tool_calls:
            printer.out.write(f"[tool call] {call['function']['name']}({call['function']['arguments']})\n")
    return message


def _cmd_generate(model, args) -> int:
    out = sys.stdout
    printer = _Printer(out, _use_color(args.color, out), show_thinking=not args.hide_think)
    prompt = args.prompt_text
    if args.raw:
        last = None
        for chunk in model.stream(prompt, max_tokens=args.max_tokens, stop=args.stop, **_sampling(args)):
            printer.chunk("", chunk.text)
            last = chunk
        printer.finish()
        stats, finish = (last.stats, last.finish_reason) if last is not None else (None, None)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        message = _run_chat_turn(model, messages, args, printer)
        stats, finish = (message.stats, message.finish_reason) if message is not None else (None, None)
    if stats is not None and not args.no_stats:
        print(_stats_line(stats, finish), file=sys.stderr)
    return 0


def _cmd_chat(model, args) -> int:
    out = sys.stdout
    color = _use_color(args.color, out)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages: list[dict] = list(system)
    interactive = sys.stdin.isatty()
    if interactive:
        cap = args.max_tokens or DEFAULT_MAX_TOKENS
        print(f"lily chat: /reset clears the conversation, /exit or Ctrl-D quits. A reply ends with the model's turn "
              f"or after {cap} tokens (--max-tokens N caps it; --no-think skips the thinking).", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            if interactive:
                print()  # the shell prompt starts on a line of its own
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages = list(system)
            model.reset()
            print("[conversation cleared]", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        printer = _Printer(out, color, show_thinking=not args.hide_think)
        try:
            message = _run_chat_turn(model, messages, args, printer)
        except KeyboardInterrupt:
            printer.finish()
            print("[interrupted]", file=sys.stderr)
            messages.pop()
            continue
        if message is None:
            messages.pop()
            continue
        messages.append(dict(message))
        if not args.no_stats:
            print(_stats_line(message.stats, message.finish_reason), file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DISPATCH:
        module = importlib.import_module(_DISPATCH[argv[0]])
        return module.main(argv[1:]) or 0
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return command.run(f"lily {args.command}", lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    try:  # every setting checked before the model loads
        Sampler(**_sampling(args))
        strings("--stop", args.stop)
        strings("--system", args.system)
        if args.command == "generate":  # standard input too: its bytes may not be UTF-8 (read as lone surrogates)
            args.prompt_text = strings("the prompt", sys.stdin.read() if args.prompt == "-" else args.prompt)[0]
            if args.raw and not args.prompt_text:
                raise ValueError("the prompt is empty (--raw uses it as is: there is nothing to continue)")
    except (TypeError, ValueError) as e:
        raise CommandError(str(e)) from None
    model = load(args.model, backend=args.backend, max_seq=args.max_seq, kv_dtype=args.kv_dtype,
                 precision=args.precision, prefix_cache_dir=args.prefix_cache_dir,
                 prefix_cache_dir_bytes=args.prefix_cache_dir_bytes,
                 prefix_cache_snapshot_every=args.prefix_cache_snapshot_every)
    try:  # what only the checkpoint can tell: the --logit-bias ids are in its vocabulary
        model.sampler(**_sampling(args))
    except (TypeError, ValueError) as e:
        raise CommandError(str(e)) from None
    if args.command == "generate":
        return _cmd_generate(model, args)
    return _cmd_chat(model, args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
