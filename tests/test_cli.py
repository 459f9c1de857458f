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
from lily.command import CommandError


def run(*args, stdin="", timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "lily", *args], input=stdin, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "args, needle",
    [
        (["generate", "/nonexistent/model", "hi"], "no such folder"),
        (["generate", "some-model", "hi", "--backend", "tpu"], "invalid choice"),
        (["chat", "some-model", "--temperature", "hot"], "expected a number >= 0, got 'hot'"),
        (["generate", "some-model", "hi", "--max-tokens", "-3"], "expected an integer >= 1"),
        (["generate", "some-model", "hi", "--logit-bias", "x"], "TOKEN_ID=BIAS"),
        (["generate", "some-model", "hi", "--no-such-flag"], "unrecognized arguments"),
        (["generate"], "required"),
        (["synth", "/", "-q"], "exists and is not empty"),
        (["synth", "/nonexistent/out", "--bits", "7"], "--bits must be one of"),
        (["bench", "/nonexistent/model"], "not a folder"),
        (["bench", "/nonexistent/model", "--lengths"], "expected one argument"),
        (["eval", "/nonexistent/model"], "not a checkpoint folder"),
        (["serve", "/nonexistent/model"], "no such folder"),
        (["serve", "x", "--port", "http"], "expected an integer from 0 to 65535"),
    ],
)
def test_bad_input_is_one_line(args, needle):
    """Every subcommand reports bad input the same way (lily.command): one line naming the command."""
    r = run(*args)
    assert r.returncode in (1, 2)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(rf"lily( {args[0]})?: error:", lines[0]) and needle in lines[0], r.stderr


BAD_FLAGS = [
    ("generate", "--max-seq", "0"), ("generate", "--max-seq", str(2**32)), ("generate", "--max-tokens", "0"),
    ("generate", "--temperature", "-1"), ("generate", "--temperature", "nan"), ("generate", "--top-k", "-1"),
    ("generate", "--top-k", "2.5"), ("generate", "--top-p", "2"), ("generate", "--min-p", "-0.5"),
    ("generate", "--repetition-penalty", "0"), ("generate", "--presence-penalty", "inf"),
    ("generate", "--frequency-penalty", "x"), ("generate", "--logit-bias", "1=nan"), ("generate", "--seed", "-1"),
    ("generate", "--seed", str(2**64)), ("generate", "--stop", "\udcff"), ("chat", "--top-k", "-3"),
    ("chat", "--system", "\udcff"), ("serve", "--port", "99999"), ("serve", "--port", "-1"),
    ("serve", "--max-seq", "0"), ("serve", "--host", "no such host!"), ("serve", "--kv-dtype", "f8"),
    ("serve", "--max-body", "0"), ("serve", "--header-timeout", "0"), ("serve", "--write-timeout", "nan"),
    ("serve", "--max-queue", "0"), ("serve", "--prefix-cache-dir-bytes", "-1"),
    ("chat", "--prefix-cache-dir-bytes", "x"), ("serve", "--prefix-cache-snapshot-every", "-1"),
    ("bench", "--max-seq", "-1"), ("bench", "--lengths", "abc"), ("bench", "--lengths", "0"),
    ("bench", "--decode-steps", "0"), ("bench", "--warmup-steps", "-1"), ("bench", "--rounds", "0"),
    ("bench", "--bandwidth-mib", "0"), ("bench", "--timeout", "-1"), ("bench", "--seed", "-1"),
    ("eval", "--positions", "0"), ("eval", "--max-seq", "0"), ("eval", "--vocab-limit", "0"),
    ("eval", "--min-top1", "101"), ("eval", "--max-kl", "nan"), ("eval", "--timeout", "-1"), ("eval", "--seed", "-1"),
    ("synth", "--layers", "0"), ("synth", "--seed", "-1"), ("synth", "--shard-size", "0"), ("synth", "--bits", "7"),
    ("synth", "--group-size", "0"), ("synth", "--set", "hidden_size=-1"), ("synth", "--set", "num_experts=1.5"),
]


@pytest.mark.parametrize("command, flag, value", BAD_FLAGS)
def test_bad_flags_fail_before_the_model_is_touched(capsys, command, flag, value):
    """A bad option value is reported (naming it) before anything is loaded or written: with a checkpoint
    that does not exist, the option's error comes first."""
    value = value.encode().decode("unicode_escape", "surrogatepass") if "\\u" in value else value
    where = "/nonexistent/out" if command == "synth" else "/nonexistent/model"
    argv = [command, where, *(["hi"] if command == "generate" else []), f"{flag}={value}"]
    if command == "synth":
        argv.append("--dry-run")
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "nonexistent" not in err and "Traceback" not in err, err
    named = value.split("=")[0] if flag == "--set" else flag.lstrip("-").replace("-", "_")
    assert flag in err or named in err or "Unicode" in err, err


@pytest.mark.parametrize("stdin, argv", [("ab\udcff", ["-"]), ("", ["-", "--raw"]), ("", ["", "--raw"])])
def test_a_bad_prompt_fails_before_the_model_is_touched(monkeypatch, capsys, stdin, argv):
    """A prompt read from standard input that is not UTF-8 (Python reads its bytes as lone surrogates) and an
    empty --raw prompt were found only after loading the model, and exited 1 as if the work had failed."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = cli.main(["generate", "/nonexistent/model", *argv])
    err = capsys.readouterr().err
    assert code == 2 and "nonexistent" not in err and "Traceback" not in err, err
    assert err.startswith("lily generate: error: ") and "prompt" in err, err


def test_serve_port_in_use_fails_before_loading(capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = cli.main(["serve", "/nonexistent/model", "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err and "nonexistent" not in err, err


def test_serve_passes_its_load_options(monkeypatch, capsys):
    """``lily serve --kv-dtype / --max-seq / --backend`` reach ``lily.load`` (as for generate and chat), after the
    port is bound."""
    import lily.loading

    seen = {}

    def load(path, **kw):
        seen.update(kw, path=path)
        raise CommandError("stop here")

    monkeypatch.setattr(lily.loading, "load", load)
    code = cli.main(["serve", "some/model", "--port", "0", "--kv-dtype", "f16", "--max-seq", "4096",
                     "--backend", "cpu", "--prefix-cache-dir", "/some/dir", "--prefix-cache-dir-bytes", "1000",
                     "--prefix-cache-snapshot-every", "512"])
    assert code == 2 and "stop here" in capsys.readouterr().err
    assert seen == {"path": "some/model", "backend": "cpu", "max_seq": 4096, "kv_dtype": "f16",
                    "prefix_cache_dir": "/some/dir", "prefix_cache_dir_bytes": 1000,
                    "prefix_cache_snapshot_every": 512}


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


def test_a_logit_bias_past_the_vocabulary_is_a_usage_error(tiny_model_dir):
    """Only the checkpoint knows its vocabulary: an id past it was accepted and biased nothing."""
    r = run("generate", str(tiny_model_dir), "Hello", "--backend", "cpu", "--max-tokens", "2",
            "--logit-bias", f"{10**7}=5")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lily generate: error: logit_bias"), r.stderr


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
