"""`lily bench`: byte accounting, length selection, the full protocol on a tiny synthetic checkpoint."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
from lily import bench, synth
from lily.bench import accounting, machine, protocol
from lily.command import CommandError

REAL_CONFIG = synth.PRESETS[synth.DEFAULT_PRESET]  # the published config.json of Qwen3.6-35B-A3B


def header_only_checkpoint(folder: Path, config=None, **kw) -> Path:
    """The full-size checkpoint's files with headers only (sparse: no disk used for the data)."""
    cfg = synth.apply_overrides(synth.load_config(config), **kw)
    tensors, q = synth.plan(cfg)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(synth._mlx_config(cfg, q, None)))
    with open(folder / "model.safetensors", "wb") as f:
        f.write(synth._header_bytes(tensors, {"format": "mlx"}))
        f.truncate(f.tell() + sum(t.nbytes for t in tensors))
    return folder


def test_bytes_per_token_of_the_real_checkpoint(tmp_path):
    bm = accounting.decode_bytes_model(header_only_checkpoint(tmp_path / "full"))
    assert bm["weights"] == 1_669_563_648  # architecture.md §10.1
    assert bm["weights_total"] == 19_508_789_376
    assert bm["kv_per_context_token"] == 20 * 1024  # 20 KiB per token of context
    assert bm["state"] == 30 * (2 * 32 * 128 * 128 * 4 + 2 * 3 * 8192 * 2)
    assert accounting.bytes_per_decoded_token(bm, 4096, 63) == bm["weights"] + bm["state"] + 20 * 1024 * 4128


def matmul_elements(heads: dict, quant: dict, prefix: str) -> int:
    """Weight-matrix elements of the tensors under ``prefix``, counted from the safetensors headers alone:
    MLX-quantized uint32 weights hold rows * scales columns * group size elements; conv1d is depthwise, not a
    matrix; 1-D tensors (norms, A_log, dt_bias) are no matrices."""
    n = 0
    for name, (dtype, shape, _) in heads.items():
        if not name.startswith(prefix) or not name.endswith(".weight") or len(shape) < 2 or ".conv1d." in name:
            continue
        module = name[: -len(".weight")]
        if module + ".scales" in heads:
            assert dtype == "U32", name
            gs = (quant.get(module) or {}).get("group_size", quant["group_size"])
            n += math.prod(heads[module + ".scales"][1]) * gs
        else:
            n += math.prod(shape)
    return n


def test_prefill_flops_match_the_checkpoint_tensors(tmp_path):
    """Matmul FLOPs of the formula (from config.json dims) against 2 x the weight elements of one layer of each
    kind, one MoE block with top-k of its experts and the lm_head, counted from a full-size checkpoint's headers."""
    cfg = copy.deepcopy(REAL_CONFIG)
    folder = header_only_checkpoint(tmp_path / "full", config=REAL_CONFIG)
    heads = accounting.read_headers(folder)
    ckpt_cfg = json.loads((folder / "config.json").read_text())
    quant = ckpt_cfg["quantization"]
    assert quant["language_model.model.layers.0.mlp.gate"]["bits"] == 8  # the per-module override path is used
    t = cfg["text_config"]
    kinds = t["layer_types"]
    lin, full = kinds.index("linear_attention"), kinds.index("full_attention")
    pre = "language_model.model.layers."
    lin_el = matmul_elements(heads, quant, f"{pre}{lin}.linear_attn.")
    full_el = matmul_elements(heads, quant, f"{pre}{full}.self_attn.")
    E, k = t["num_experts"], t["num_experts_per_tok"]
    experts = matmul_elements(heads, quant, f"{pre}{lin}.mlp.switch_mlp.")
    assert experts % E == 0
    moe_el = matmul_elements(heads, quant, f"{pre}{lin}.mlp.") - experts + k * (experts // E)
    assert matmul_elements(heads, quant, f"{pre}{full}.mlp.") == matmul_elements(heads, quant, f"{pre}{lin}.mlp.")
    head_el = matmul_elements(heads, quant, "language_model.lm_head.")
    for prompt in (1, 256, 4096):
        f = accounting.prefill_flops_per_token(cfg, prompt)
        assert f["matmul_linear_layer"] == 2 * lin_el == 2 * 33_685_504  # architecture.md §10: projections
        assert f["matmul_full_attention_layer"] == 2 * full_el == 2 * (27_263_488 - 512)  # less q/k norms
        assert f["matmul_moe_layer"] == 2 * moe_el
        assert f["matmul_lm_head"] == 2 * head_el / prompt
        assert (f["linear_layers"], f["full_attention_layers"]) == (kinds.count("linear_attention"), 10)
        total = 30 * 2 * lin_el + 10 * 2 * full_el + 40 * 2 * moe_el + 2 * head_el / prompt
        assert f["matmul"] == pytest.approx(total, rel=1e-12)
        assert f["attention"] == pytest.approx(10 * 4 * 16 * 256 * (prompt + 1) / 2)
        assert f["delta_net"] == 30 * 7 * 32 * 128 * 128
        assert f["conv"] == 30 * 2 * 4 * 8192
        assert f["total"] == pytest.approx(f["matmul"] + f["attention"] + f["delta_net"] + f["conv"])
    # §10 "active per token" 2,946,431,616 params, less those that are no matrices (norms, conv, A_log, dt_bias,
    # the embedding row): at prompt 1 every matrix is used once per token
    not_matrices = 10 * 2 * 256 + 30 * (8192 * 4 + 32 + 32 + 128) + 40 * 2 * 2048 + 2048 + 2048
    assert accounting.prefill_flops_per_token(cfg, 1)["matmul"] == 2 * (2_946_431_616 - not_matrices)


def test_prefill_flops_follow_the_config():
    """The layer-kind rule without layer_types, no shared expert, no output gate."""
    cfg = copy.deepcopy(REAL_CONFIG)
    t = cfg["text_config"]
    del t["layer_types"]
    t["num_hidden_layers"], t["full_attention_interval"] = 6, 3
    base = accounting.prefill_flops_per_token(cfg, 64)
    assert (base["linear_layers"], base["full_attention_layers"]) == (4, 2)
    t["shared_expert_intermediate_size"] = 0
    t["attn_output_gate"] = False
    f = accounting.prefill_flops_per_token(cfg, 64)
    assert base["matmul_moe_layer"] - f["matmul_moe_layer"] == 2 * (3 * 2048 * 512 + 2048)
    assert base["matmul_full_attention_layer"] - f["matmul_full_attention_layer"] == 2 * 2048 * 16 * 256


def test_peak_flops_is_measured():
    for method in ("numpy", "mlx"):
        pk = machine.measure_peak_flops(method, repeats=2, n=256)
        assert math.isfinite(pk["peak_gflops"]) and pk["peak_gflops"] > 0.01, pk
        assert pk["peak_method"].startswith(f"{method} f32 matmul 256^2")
    assert f"{machine.usable_cpus()} cpus" in machine.measure_peak_flops("numpy", repeats=1, n=64)["peak_method"]


def test_lengths_and_fit():
    assert protocol.parse_lengths("256, 1K,4k") == [256, 1024, 4096]
    with pytest.raises(CommandError):
        protocol.parse_lengths("12x")
    bm = {"kv_per_context_token": 20480}
    assert protocol.fits(256, 64, 512, bm, 0, 0) is None
    assert "max_seq" in protocol.fits(512, 64, 512, bm, 0, 0)
    assert "GB" in protocol.fits(131072, 64, None, bm, 2 << 30, 1 << 30)


def test_bandwidth_is_measured():
    bw = machine.measure_bandwidth(64 << 20, repeats=2)
    assert bw["memory_bandwidth_gbps"] > 0.1 and bw["read_bandwidth_gbps"] > 0.1


def check_records(data, lengths, compare=False):
    cfg = json.loads((Path(data["meta"]["model"]) / "config.json").read_text())
    recs = data["records"]
    assert [r["prompt_tokens"] for r in recs] == lengths
    for r in recs:
        for k in ("prefill_tok_s", "decode_tok_s", "decode_effective_gbps", "memory_bandwidth_gbps",
                  "decode_bandwidth_fraction", "read_bandwidth_gbps", "decode_read_bandwidth_fraction",
                  "peak_memory_bytes"):
            assert r[k] > 0, k
        assert len(r["decode_tok_s_rounds"]) == 2 and "decode_drift" in r
        for d in [r] + ([r["mlx_lm"]] if compare else []):
            assert d["prefill_flops_per_token"] == accounting.prefill_flops_per_token(cfg, r["prompt_tokens"])["total"]
            assert d["prefill_gflops"] == pytest.approx(d["prefill_tok_s"] * d["prefill_flops_per_token"] / 1e9)
            assert d["peak_gflops"] == data["meta"]["peak_gflops"] > 0
            assert 0 < d["prefill_peak_fraction"] < 1.5
            assert d["prefill_peak_fraction"] == pytest.approx(d["prefill_gflops"] / d["peak_gflops"])
        if compare:
            assert r["mlx_lm"]["decode_tok_s"] > 0 and r["decode_ratio"] > 0
    assert data["meta"]["machine"]["cpu_count"] >= 1
    assert data["meta"]["peak_method"].startswith("numpy f32 matmul")


def check_table(out: str):
    lines = out.splitlines()
    head = next(line for line in lines if "prefill tok/s" in line).split("  ")
    cols = [c.strip() for c in head if c.strip()]
    assert cols[cols.index("prefill tok/s") + 1] == "of peak"
    assert cols.index("of read BW") < cols.index("of copy BW")
    foot = next(line for line in lines if "memory bandwidth" in line)
    assert foot.index("GB/s read") < foot.index("GB/s copy") < foot.index("f32 matmul peak")
    assert "GFLOP/s (numpy f32 matmul 2048^2," in foot


def test_bench_protocol_with_mlx_lm(tiny_synth, tmp_path, capsys):
    js = tmp_path / "b.json"
    rc = bench.main([str(tiny_synth), "--engine", "mlx-lm", "--mlx-dtype", "float32", "--lengths", "32,64",
                     "--decode-steps", "4", "--json", str(js), "--bandwidth-mib", "64", "--same-process"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "prefill tok/s" in out and "memory bandwidth" in out and "of peak" in out
    check_table(out)
    check_records(json.loads(js.read_text()), [32, 64])


def test_plot(tiny_synth, tmp_path):
    png = tmp_path / "b.png"
    assert bench.main([str(tiny_synth), "--engine", "mlx-lm", "--mlx-dtype", "float32", "--lengths", "16,32",
                       "--decode-steps", "2", "--rounds", "1", "--plot", str(png), "--bandwidth-mib", "64",
                       "--same-process", "-q"]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_lily_compare_mlx_lm(tiny_synth, tmp_path, capsys):
    js = tmp_path / "b.json"
    rc = bench.main([str(tiny_synth), "--backend", "cpu", "--lengths", "32,128", "--decode-steps", "8",
                     "--json", str(js), "--compare", "mlx-lm", "--bandwidth-mib", "64"])
    assert rc == 0
    out, err = capsys.readouterr()
    check_table(out)
    data = json.loads(js.read_text())
    check_records(data, [32, 128], compare=True)
    assert data["meta"]["backend"] and data["meta"]["engine"] == "lily"
    # on a CPU, MLX-LM runs in fp32 unless told otherwise (its bf16 path is ~8x slower), without a warning
    assert data["meta"]["mlx_dtype"] == "float32" and data["records"][0]["mlx_lm"]["backend"].endswith("fp32")
    assert "warning" not in err and "lily bench: 8/8 runs, " in err and " left" in err


def test_mlx_bf16_on_a_cpu_is_warned_about(capsys):
    assert protocol._mlx_dtype("native") == "native"
    assert "about 8x slower than with --mlx-dtype float32" in capsys.readouterr().err
    assert protocol._mlx_dtype("float32") == "float32" and capsys.readouterr().err == ""


def test_time_left_is_unknown_until_every_engine_ran(capsys):
    """One fast Lily run must not turn into an estimate for a slow MLX-LM run (the 8 s estimate of a 19 min
    benchmark); after both engines ran once, the estimate scales each engine's own rate."""
    runs = [("lily", [256]), ("mlx-lm", [256]), ("lily", [512]), ("mlx-lm", [512])]
    status = protocol.Status(runs, steps=64, warmup=2, enabled=False)
    assert status.left("lily", 0.0).startswith("time left: unknown")
    status.finished("lily", [256], 8.0)
    assert status.left("mlx-lm", 30.0).startswith("time left: unknown")
    status.finished("mlx-lm", [256], 1000.0)
    scale = status.work([512]) / status.work([256])
    want = (8.0 + 1000.0) * scale - 100.0
    assert status.left("lily", 100.0) == f"about {protocol._duration(want)} left" and want > 15 * 60


def test_cli_errors(tmp_path, capsys):
    assert bench.main([str(tmp_path / "nope")]) == 2
    (tmp_path / "x").mkdir()
    assert bench.main([str(tmp_path / "x")]) == 2
    with pytest.raises(SystemExit) as ei:  # an option value argparse refuses
        bench.main([str(tmp_path / "x"), "--decode-steps", "0"])
    assert ei.value.code == 2
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


def test_bench_concurrency(tiny_synth, tmp_path, capsys):
    js = tmp_path / "c.json"
    rc = bench.main([str(tiny_synth), "--backend", "cpu", "--lengths", "16", "--decode-steps", "3",
                     "--rounds", "1", "--concurrency", "1,2,4", "--json", str(js), "-q"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "aggregate tok/s" in out and "per-seq tok/s" in out
    recs = json.loads(js.read_text())["records"]
    assert [r["concurrency"] for r in recs] == [1, 2, 4]
    for r in recs:
        assert r["aggregate_decode_tok_s"] > 0
        assert abs(r["per_sequence_decode_tok_s"] * r["concurrency"] - r["aggregate_decode_tok_s"]) < 1e-6
        assert r["bytes_per_step"] > 0
    assert recs[0]["speedup_vs_1"] == 1.0
    assert recs[2]["bytes_per_step"] > recs[0]["bytes_per_step"]  # more experts and states per step
    with pytest.raises(SystemExit):
        bench.main([str(tiny_synth), "--concurrency", "0,2"])
