"""``lily bench --compare llama.cpp``: the GGUF of a checkpoint's shapes, and both engines in one run.

The end-to-end test needs a ``llama-bench`` binary: ``LILY_LLAMA_BENCH=PATH`` or one on PATH. It is skipped
only when there is none; a binary that is named but fails makes the test fail."""

from __future__ import annotations

import json
import os
import shutil

import gguf
import numpy as np
import pytest
from lily import bench
from lily.bench import gguf as lily_gguf
from lily.bench import llamacpp
from lily.command import CommandError
from lily.synth import Dims

LLAMA_BENCH = os.environ.get("LILY_LLAMA_BENCH") or shutil.which("llama-bench")


def test_gguf_holds_every_tensor_of_the_checkpoint_shapes(tiny_synth, tmp_path):
    cfg = json.loads((tiny_synth / "config.json").read_text())
    out = tmp_path / "m.gguf"
    nbytes = lily_gguf.write_gguf(cfg, out, seed=3)
    assert not (tmp_path / "m.gguf.partial").exists()
    r = gguf.GGUFReader(out)
    d = Dims.of(cfg)
    kv = {k: f.contents() for k, f in r.fields.items()}
    assert kv["general.architecture"] == "qwen35moe" and kv["tokenizer.ggml.model"] == "none"
    assert kv["qwen35moe.block_count"] == d.L and kv["qwen35moe.vocab_size"] == d.V
    assert kv["qwen35moe.expert_count"] == d.E and kv["qwen35moe.expert_used_count"] == d.topk
    assert kv["qwen35moe.attention.recurrent_layers"] == [d.is_linear(i) for i in range(d.L)]
    assert kv["qwen35moe.rope.dimension_count"] == d.hd // 4  # partial_rotary_factor 0.25
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == len(lily_gguf.gguf_plan(d)) and sum(int(t.n_bytes) for t in r.tensors) == nbytes
    # ggml order: inputs first
    assert list(tensors["blk.0.ffn_gate_exps.weight"].shape) == [d.D, d.I, d.E]
    assert list(tensors["blk.0.ffn_down_exps.weight"].shape) == [d.I, d.D, d.E]
    assert list(tensors["blk.3.attn_q.weight"].shape) == [d.D, 2 * d.H * d.hd]
    assert tensors["blk.0.attn_qkv.weight"].tensor_type.name == "Q4_0"
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "Q8_0"
    assert tensors["blk.0.ssm_a"].tensor_type.name == "F32"
    assert (np.asarray(tensors["blk.0.ssm_a"].data) < 0).all()
    # 4.5 bits per weight for the 4-bit matrices, as MLX 4-bit group 64
    emb = tensors["token_embd.weight"]
    assert int(emb.n_bytes) * 8 / (d.V * d.D) == 4.5
    # the Q4_0 scales give the intended std: d (q - 8), std 1 / sqrt(fan_in)
    blocks = np.asarray(tensors["blk.0.attn_qkv.weight"].data).reshape(-1, 18)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = np.stack([blocks[:, 2:] & 15, blocks[:, 2:] >> 4], axis=-1).reshape(len(blocks), -1).astype(np.float32)
    w = scale * (q - 8)
    assert np.std(w) == pytest.approx(1 / np.sqrt(d.D), rel=0.1)


def test_gguf_refuses_rows_that_are_not_whole_blocks():
    cfg = {"text_config": dict(_tiny_text(), hidden_size=48)}
    with pytest.raises(CommandError, match="multiple of the GGUF block"):
        lily_gguf.gguf_plan(Dims.of(cfg))


def _tiny_text() -> dict:
    return {"hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 128, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 32, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
            "linear_key_head_dim": 32, "linear_value_head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"]}


def test_missing_llama_bench_is_a_clear_error(tiny_synth, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert bench.main([str(tiny_synth), "--lengths", "16", "--compare", "llama.cpp"]) == 2
    assert "needs a llama-bench binary" in capsys.readouterr().err
    assert bench.main([str(tiny_synth), "--lengths", "16", "--compare", "llama.cpp",
                       "--llama-bench", str(tmp_path / "nope")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_failing_llama_bench_fails_the_run(tiny_synth, tmp_path, capsys):
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\necho 'error: no model' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(CommandError, match=r"llama-bench failed \(exit 3\): error: no model"):
        llamacpp.llama_bench_records(fake, tmp_path / "m.gguf", [16], 2, 1)


@pytest.mark.skipif(LLAMA_BENCH is None, reason="no llama-bench binary (LILY_LLAMA_BENCH or PATH)")
def test_compare_llama_cpp_in_one_run(tiny_synth, tmp_path, capsys):
    js, kept = tmp_path / "b.json", tmp_path / "kept.gguf"
    rc = bench.main([str(tiny_synth), "--backend", "cpu", "--lengths", "32,64", "--decode-steps", "4",
                     "--compare", "llama.cpp", "--llama-bench", str(LLAMA_BENCH), "--gguf", str(kept),
                     "--threads", "2", "--json", str(js), "--bandwidth-mib", "64"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "llama.cpp prefill" in out and "llama.cpp decode" in out and "prefill x" in out
    data = json.loads(js.read_text())
    assert data["meta"]["threads"] == 2 and data["meta"]["compare"] == "llama.cpp"
    for r in data["records"]:
        c = r["llama_cpp"]
        assert c["prefill_tok_s"] > 0 and c["decode_tok_s"] > 0 and len(c["prefill_tok_s_rounds"]) == 2
        assert c["backend"].startswith("llama.cpp")
        assert r["prefill_ratio"] == pytest.approx(r["prefill_tok_s"] / c["prefill_tok_s"])
        assert r["decode_ratio"] == pytest.approx(r["decode_tok_s"] / c["decode_tok_s"])
    assert kept.is_file()  # --gguf keeps the file for the next run
    before = kept.stat().st_mtime_ns
    assert bench.main([str(tiny_synth), "--backend", "cpu", "--lengths", "16", "--decode-steps", "2", "--rounds", "1",
                       "--compare", "llama.cpp", "--llama-bench", str(LLAMA_BENCH), "--gguf", str(kept),
                       "--bandwidth-mib", "64", "-q"]) == 0
    assert kept.stat().st_mtime_ns == before
