"""`lily bench`: byte accounting, length selection, the full protocol on a tiny synthetic checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lily import bench, synth


def header_only_checkpoint(folder: Path, **kw) -> Path:
    """The full-size checkpoint's files with headers only (sparse: no disk used for the data)."""
    cfg = synth.apply_overrides(synth.load_config(None), **kw)
    tensors, q = synth.plan(cfg)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(synth._mlx_config(cfg, q, None)))
    with open(folder / "model.safetensors", "wb") as f:
        f.write(synth._header_bytes(tensors, {"format": "mlx"}))
        f.truncate(f.tell() + sum(t.nbytes for t in tensors))
    return folder


def test_bytes_per_token_of_the_real_checkpoint(tmp_path):
    bm = bench.decode_bytes_model(header_only_checkpoint(tmp_path / "full"))
    assert bm["weights"] == 1_669_563_648  # architecture.md §10.1
    assert bm["weights_total"] == 19_508_789_376
    assert bm["kv_per_context_token"] == 20 * 1024  # 20 KiB per token of context
    assert bm["state"] == 30 * (2 * 32 * 128 * 128 * 4 + 2 * 3 * 8192 * 2)
    assert bench.bytes_per_decoded_token(bm, 4096, 63) == bm["weights"] + bm["state"] + 20 * 1024 * 4128


def test_lengths_and_fit():
    assert bench.parse_lengths("256, 1K,4k") == [256, 1024, 4096]
    with pytest.raises(bench.BenchError):
        bench.parse_lengths("12x")
    bm = {"kv_per_context_token": 20480}
    assert bench.fits(256, 64, 512, bm, 0, 0) is None
    assert "max_seq" in bench.fits(512, 64, 512, bm, 0, 0)
    assert "GB" in bench.fits(131072, 64, None, bm, 2 << 30, 1 << 30)


def test_bandwidth_is_measured():
    bw = bench.measure_bandwidth(64 << 20, repeats=2)
    assert bw["memory_bandwidth_gbps"] > 0.1 and bw["read_bandwidth_gbps"] > 0.1


def check_records(data, lengths, compare=False):
    recs = data["records"]
    assert [r["prompt_tokens"] for r in recs] == lengths
    for r in recs:
        for k in ("prefill_tok_s", "decode_tok_s", "decode_effective_gbps", "memory_bandwidth_gbps",
                  "decode_bandwidth_fraction", "read_bandwidth_gbps", "decode_read_bandwidth_fraction",
                  "peak_memory_bytes"):
            assert r[k] > 0, k
        assert len(r["decode_tok_s_rounds"]) == 2 and "decode_drift" in r
        if compare:
            assert r["mlx_lm"]["decode_tok_s"] > 0 and r["decode_ratio"] > 0
    assert data["meta"]["machine"]["cpu_count"] >= 1


def test_bench_protocol_with_mlx_lm(tiny_synth, tmp_path, capsys):
    js = tmp_path / "b.json"
    rc = bench.main([str(tiny_synth), "--engine", "mlx-lm", "--mlx-dtype", "float32", "--lengths", "32,64",
                     "--decode-steps", "4", "--json", str(js), "--bandwidth-mib", "64", "--same-process"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "prefill tok/s" in out and "memory bandwidth" in out
    check_records(json.loads(js.read_text()), [32, 64])


def test_plot(tiny_synth, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "b.png"
    assert bench.main([str(tiny_synth), "--engine", "mlx-lm", "--mlx-dtype", "float32", "--lengths", "16,32",
                       "--decode-steps", "2", "--rounds", "1", "--plot", str(png), "--bandwidth-mib", "64",
                       "--same-process", "-q"]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_lily_compare_mlx_lm(tiny_synth, tmp_path):
    js = tmp_path / "b.json"
    rc = bench.main([str(tiny_synth), "--backend", "cpu", "--lengths", "32,128", "--decode-steps", "8",
                     "--json", str(js), "--compare", "mlx-lm", "--mlx-dtype", "float32", "--bandwidth-mib", "64",
                     "-q"])
    assert rc == 0
    data = json.loads(js.read_text())
    check_records(data, [32, 128], compare=True)
    assert data["meta"]["backend"] and data["meta"]["engine"] == "lily"


def test_cli_errors(tmp_path, capsys):
    assert bench.main([str(tmp_path / "nope")]) == 2
    (tmp_path / "x").mkdir()
    assert bench.main([str(tmp_path / "x")]) == 2
    assert bench.main([str(tmp_path / "x"), "--decode-steps", "0"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("lily bench: error:") == 3


def test_worker_failure_is_one_line(tiny_synth, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny_synth.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    st = bad / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-4096])  # truncated data, intact header
    rc = bench.main([str(bad), "--engine", "mlx-lm", "--lengths", "16", "--decode-steps", "1", "--rounds", "1",
                     "--bandwidth-mib", "16", "-q"])
    assert rc == 1
    assert "Traceback" not in capsys.readouterr().err
