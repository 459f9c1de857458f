"""The ``lily`` command driven as a subprocess (errors, generate, chat) and its subcommand dispatch."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import types
from pathlib import Path

import fixtures
import pytest
from lily import cli


def run(*args, stdin="", timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "lily", *args], input=stdin, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "args, needle",
    [
        (["generate", "/nonexistent/model", "hi"], "no such folder"),
        (["generate", "some-model", "hi", "--backend", "tpu"], "invalid choice"),
        (["chat", "some-model", "--temperature", "hot"], "invalid float"),
        (["generate", "some-model", "hi", "--max-tokens", "-3"], "positive integer"),
        (["generate", "some-model", "hi", "--logit-bias", "x"], "TOKEN_ID=BIAS"),
        (["generate", "some-model", "hi", "--no-such-flag"], "unrecognized arguments"),
        (["generate"], "required"),
        (["synth", "/", "-q"], "exists and is not empty"),
        (["synth", "/nonexistent/out", "--bits", "7"], "--bits must be one of"),
        (["bench", "/nonexistent/model"], "not a folder"),
        (["bench", "/nonexistent/model", "--lengths"], "expected one argument"),
        (["eval", "/nonexistent/model"], "not a checkpoint folder"),
        (["serve", "/nonexistent/model"], "no such folder"),
        (["serve", "x", "--port", "http"], "invalid int value"),
    ],
)
def test_bad_input_is_one_line(args, needle):
    """Every subcommand reports bad input the same way (lily.command): one line naming the command."""
    r = run(*args)
    assert r.returncode in (1, 2)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(rf"lily( {args[0]})?: error:", lines[0]) and needle in lines[0], r.stderr


def test_help_lists_commands():
    r = run("--help")
    assert r.returncode == 0
    for name in ("generate", "chat", "synth", "bench", "eval"):
        assert name in r.stdout


@pytest.mark.parametrize("name", ["synth", "bench", "eval"])
def test_dispatch_passes_argv(monkeypatch, name):
    seen = {}
    fake = types.ModuleType(f"lily.{name}")
    fake.main = lambda argv: seen.setdefault("argv", argv) and 7
    monkeypatch.setitem(sys.modules, f"lily.{name}", fake)
    assert cli.main([name, "--x", "1"]) == 7
    assert seen["argv"] == ["--x", "1"]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli") / "ckpt"
    fixtures.write_hf_checkpoint(folder, preset="tiny", seed=0, real_tokenizer=True)
    return folder


def test_generate_streams_with_stats(tiny_model_dir):
    r = run("generate", str(tiny_model_dir), "Hello", "--backend", "cpu", "--max-tokens", "8", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() != "" or "finish" in r.stderr
    assert "tok/s" in r.stderr and "ttft" in r.stderr
    again = run("generate", str(tiny_model_dir), "Hello", "--backend", "cpu", "--max-tokens", "8", "--seed", "1")
    assert again.stdout == r.stdout  # same seed, same text
    raw = run("generate", str(tiny_model_dir), "Hello", "--raw", "--temp", "0", "--max-tokens", "4", "--no-stats")
    assert raw.returncode == 0 and raw.stderr.strip() == ""


def test_chat_session(tiny_model_dir):
    r = run(
        "chat", str(tiny_model_dir), "--max-tokens", "5", "--no-think", "--temperature", "0",
        stdin="Hi there\n/reset\nSecond question\n/exit\nnever read\n",
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("ttft") == 2 and "[conversation cleared]" in r.stderr
    assert "\x1b[2m" not in r.stdout  # not a terminal: no colour codes


def printed(show_thinking: bool, chunks, finish="stop", max_tokens=None) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    printer = cli._Printer(out, color=False, show_thinking=show_thinking, err=err)
    for reasoning, content in chunks:
        printer.chunk(reasoning, content)
    printer.finish(finish, max_tokens)
    return out.getvalue(), err.getvalue()


REPLY = [("Hmm,", ""), (" hi", ""), ("", ""), ("", "Hello"), ("", "!")]


def test_thinking_is_labelled():
    assert printed(True, REPLY) == ("thinking:\nHmm, hi\n\nHello!\n", "")


def test_hidden_thinking_is_one_line():
    out, err = printed(False, REPLY)
    assert out == "Hello!\n" and re.fullmatch(r"thinking: 3 tokens, \d+\.\d s \(hidden\)\n", err), err


@pytest.mark.parametrize("show", [True, False])
def test_a_reply_that_is_all_thinking_says_so(show):
    out, err = printed(show, REPLY[:2], finish="length", max_tokens=2)
    assert out == ("thinking:\nHmm, hi\n\n\n" if show else "")
    assert err.endswith("[no answer: it reached --max-tokens 2 while thinking; raise --max-tokens, or --no-think]\n")
    _, err = printed(show, REPLY[:2], finish="stop")
    assert err.endswith("[no answer: the model ended its turn while thinking]\n")


def spawn_chat(folder, *flags):
    import pexpect

    return pexpect.spawn(sys.executable, ["-m", "lily", "chat", str(folder), "--backend", "cpu", "--temperature", "0",
                                          *flags], encoding="utf-8", timeout=120, dimensions=(40, 200))


def test_chat_in_a_terminal(tiny_model_dir):
    """Under a pseudo-terminal: the banner says how to cap a reply, the (random) model thinks for the whole
    reply, --hide-think shows that as one line plus a note instead of nothing, Ctrl-D leaves on a new line."""
    child = spawn_chat(tiny_model_dir, "--hide-think", "--max-tokens", "6")
    child.expect_exact("after 6 tokens (--max-tokens N caps it; --no-think skips the thinking).")
    child.expect_exact("> ")
    child.sendline("Hi")
    child.expect(r"thinking: 6 tokens, [0-9.]+ s \(hidden\)")
    child.expect_exact("[no answer: it reached --max-tokens 6 while thinking; raise --max-tokens, or --no-think]")
    child.expect(r"tok/s .*finish: length\]")
    child.expect_exact("> ")
    child.sendeof()
    child.expect(pexpect_eof())
    assert child.before == "\r\n"  # Ctrl-D's newline, nothing else
    child.close()
    assert child.exitstatus == 0


def test_chat_shows_labelled_thinking_in_a_terminal(tiny_model_dir):
    child = spawn_chat(tiny_model_dir, "--max-tokens", "4")
    child.expect_exact("> ")
    child.sendline("Hi")
    child.expect_exact("\x1b[2mthinking:\x1b[0m\r\n\x1b[2m")  # dimmed header, then the dimmed thinking
    child.expect_exact("[no answer: it reached --max-tokens 4 while thinking")
    child.sendline("/exit")
    child.expect(pexpect_eof())
    child.close()
    assert child.exitstatus == 0


def pexpect_eof():
    import pexpect

    return pexpect.EOF


def test_the_load_bar_clears_itself(tmp_path):
    """The bar of lily.load's weight read leaves an empty line behind (tqdm leave=False)."""
    import pexpect

    (tmp_path / "model.safetensors").write_bytes(b"x" * 4096)
    code = f"from pathlib import Path; from lily.hub import warm_page_cache; " \
           f"warm_page_cache(Path({str(tmp_path)!r}), min_bytes=0); print('done')"
    child = pexpect.spawn(sys.executable, ["-c", code], encoding="utf-8", timeout=60)
    child.expect(pexpect.EOF)
    raw = child.before
    assert "Reading weights" in raw
    assert [line.strip() for line in terminal_lines(raw) if line.strip()] == ["done"], raw


def terminal_lines(raw: str) -> list[str]:
    """What a terminal shows for ``raw``: each \\r returns to the line's start and overwrites from there."""
    lines = []
    for line in raw.replace("\r\n", "\n").split("\n"):
        shown: list[str] = []
        for part in line.split("\r"):
            shown[: len(part)] = part
        lines.append("".join(shown))
    return lines


def test_cli_docs_are_current():
    """docs/cli.md lists every argument of every command, as the parsers define them."""
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(root / "scripts" / "cli_docs.py"), "--check"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
