"""`lily eval`: metrics, saved references, --text, and Lily against MLX-LM on a tiny synthetic checkpoint."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from lily import eval as leval
from lily.command import CommandError


def test_metrics():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(5, 50)).astype(np.float32)
    m = leval.compare(a, a.copy(), np.arange(5))
    assert m["top1_agreement"] == 1.0 and m["kl_mean"] == 0.0 and m["max_abs_logit_diff"] == 0.0
    assert m["perplexity_delta_pct"] == 0.0
    b = a + 0.5  # a constant shift does not change the distribution
    m = leval.compare(a, b, np.arange(5))
    assert m["kl_max"] < 1e-9 and abs(m["max_abs_logit_diff"] - 0.5) < 1e-6
    c = a.copy()
    c[:, 0] += 100.0
    m = leval.compare(a, c, np.zeros(5, dtype=int))
    assert m["top1_agreement"] == 0.0 and m["kl_mean"] > 1.0 and m["perplexity_delta_pct"] < 0
    m = leval.compare(a, c, np.zeros(5, dtype=int), vocab_limit=1)  # only row 0: identical after softmax
    assert m["kl_max"] == 0.0
    with pytest.raises(CommandError):
        leval.compare(a, a[:, :10], None)


def test_mlx_against_itself_and_saved_reference(tiny_synth, tmp_path, capsys):
    ref = tmp_path / "ref.npz"
    js = tmp_path / "e.json"
    assert leval.main([str(tiny_synth), "--engine", "mlx-lm", "--positions", "40", "--mode", "mixed",
                       "--save-reference", str(ref), "--json", str(js)]) == 0
    m = json.loads(js.read_text())["metrics"]
    assert m["positions"] == 40 and m["top1_agreement"] == 1.0 and m["max_abs_logit_diff"] < 1e-4
    z = np.load(ref)
    assert z["logits"].shape == (40, 1024) and z["tokens"].shape == (41,)
    # the saved reference against MLX-LM's bf16 path: close, not equal
    assert leval.main([str(tiny_synth), "--engine", "mlx-lm", "--reference", str(ref), "--mlx-dtype", "native",
                       "--json", str(js), "--min-top1", "50"]) == 0
    m = json.loads(js.read_text())["metrics"]
    assert 0 < m["max_abs_logit_diff"] < 3 and m["kl_mean"] < 0.1
    assert "top-1 agreement" in capsys.readouterr().out


def test_text(tiny_synth, tmp_path):
    txt = tmp_path / "t.txt"
    txt.write_text("Lily runs Qwen3.6 on a laptop. " * 4)
    js = tmp_path / "e.json"
    assert leval.main([str(tiny_synth), "--engine", "mlx-lm", "--text", str(txt), "--positions", "50",
                       "--json", str(js)]) == 0
    data = json.loads(js.read_text())
    assert data["metrics"]["positions"] == 50 and data["meta"]["tokens"] == "text t.txt"


@pytest.mark.parametrize("mode", ["prefill", "mixed"])
def test_lily_matches_mlx_lm(tiny_synth, tmp_path, mode):
    js = tmp_path / "e.json"
    rc = leval.main([str(tiny_synth), "--backend", "cpu", "--positions", "64", "--mode", mode, "--json", str(js),
                     "--min-top1", "90"])
    m = json.loads(js.read_text())["metrics"]
    assert rc == 0, m
    assert m["kl_mean"] < 2e-3, m


def test_cli_errors(tiny_synth, tmp_path, capsys):
    assert leval.main([str(tmp_path)]) == 2
    assert leval.main([str(tiny_synth), "--reference", str(tmp_path / "missing.npz")]) == 2
    bad = tmp_path / "bad.npz"
    np.savez(bad, logits=np.zeros((3, 1024), np.float32), tokens=np.zeros(9, np.int32))
    assert leval.main([str(tiny_synth), "--reference", str(bad)]) == 2
    assert leval.main([str(tiny_synth), "--text", str(tmp_path / "none.txt"), "--engine", "mlx-lm"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("lily eval: error:") == 4


@pytest.mark.parametrize("value", ["100.5", "-1", "nan", "x"])
def test_min_top1_is_a_percentage(tiny_synth, value):
    r = subprocess.run([sys.executable, "-m", "lily", "eval", str(tiny_synth), "--min-top1", value],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("lily eval: error: argument --min-top1:") and value in r.stderr


def test_min_top1_fails_below_the_percentage(tiny_synth, tmp_path, capsys):
    """Saved bf16 logits against MLX-LM's fp32 run agree on most, not all, positions: a threshold just above the
    agreement fails and names both in percent."""
    ref = tmp_path / "ref.npz"
    assert leval.main([str(tiny_synth), "--engine", "mlx-lm", "--positions", "64", "--mlx-dtype", "native",
                       "--save-reference", str(ref)]) == 0
    js = tmp_path / "e.json"
    assert leval.main([str(tiny_synth), "--engine", "mlx-lm", "--reference", str(ref), "--mlx-dtype", "float32",
                       "--json", str(js)]) == 0
    agreement = math.floor(100 * 100 * json.loads(js.read_text())["metrics"]["top1_agreement"]) / 100
    assert agreement < 99.99
    capsys.readouterr()
    assert leval.main([str(tiny_synth), "--engine", "mlx-lm", "--reference", str(ref), "--mlx-dtype", "float32",
                       "--min-top1", f"{agreement:.2f}"]) == 0
    assert leval.main([str(tiny_synth), "--engine", "mlx-lm", "--reference", str(ref), "--mlx-dtype", "float32",
                       "--min-top1", f"{agreement + 0.01:.2f}"]) == 1
    assert f"% < {agreement + 0.01:.2f} %" in capsys.readouterr().err
