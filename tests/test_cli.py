"""The ``lily`` command driven as a subprocess (errors, generate, chat) and its subcommand dispatch."""

from __future__ import annotations

import re
import subprocess
import sys
import types

import lily
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
    fixtures = pytest.importorskip("fixtures")
    folder = tmp_path_factory.mktemp("cli") / "ckpt"
    fixtures.write_hf_checkpoint(folder, preset="tiny", seed=0, real_tokenizer=True)
    try:
        lily.Engine(str(folder), backend="cpu", max_seq=64)
    except lily.LilyError as e:  # pragma: no cover
        pytest.skip(f"engine cannot load the tiny checkpoint: {e}")
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
