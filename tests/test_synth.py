"""`lily synth`: layout identical to mlx_lm.convert, loads in MLX-LM, finite through 40 layers, full width."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from lily import synth


def headers(folder) -> dict:
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            h = json.loads(fh.read(n))
        h.pop("__metadata__", None)
        out.update({k: (v["dtype"], tuple(v["shape"])) for k, v in h.items()})
    return out


def mlx_forward(folder, tokens, dtype="float32") -> np.ndarray:
    import mlx.core as mx
    from lily.mlx_reference import load_mlx_model

    model, _ = load_mlx_model(Path(folder), dtype)
    out = model(mx.array(np.asarray(tokens, np.int32))[None]).astype(mx.float32)
    mx.eval(out)
    return np.array(out[0])


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A real_heads HF checkpoint and what mlx_lm.convert makes of it."""
    from fixtures import convert_mlx, write_hf_checkpoint

    base = tmp_path_factory.mktemp("conv")
    hf = write_hf_checkpoint(base / "hf", preset="real_heads")
    return hf, convert_mlx(hf, base / "mlx")


def test_layout_matches_mlx_convert(converted, tmp_path):
    hf, ref = converted
    out = tmp_path / "synth"
    assert synth.main([str(out), "--config", str(hf / "config.json"), "-q"]) == 0
    assert headers(out) == headers(ref)
    assert json.loads((out / "config.json").read_text()) == json.loads((ref / "config.json").read_text())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(headers(out))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).is_file()


def test_hf_layout_matches_released_names(converted, tmp_path):
    hf, ref = converted
    out = tmp_path / "hf"
    assert synth.main([str(out), "--config", str(hf / "config.json"), "--format", "hf", "-q"]) == 0
    want = {k: v for k, v in headers(hf).items() if not k.startswith(("model.visual.", "mtp."))}
    assert headers(out) == want
    # and mlx_lm.convert turns it into exactly the layout `lily synth` writes directly
    from fixtures import convert_mlx

    assert headers(convert_mlx(out, tmp_path / "hf-mlx")) == headers(ref)


def test_random_quantized_weights_have_the_intended_std(tmp_path):
    out = tmp_path / "s"
    synth.synthesize(out, "qwen3.6-35b-a3b", sets=["hidden_size=256", "num_experts=8", "vocab_size=512",
                                                   "num_hidden_layers=4"], progress=False)
    from oracle import dequantized_weights

    w = dequantized_weights(out)
    q = w["language_model.model.layers.0.linear_attn.in_proj_qkv.weight"]
    assert abs(q.std() * np.sqrt(256) - 1.0) < 0.1 and abs(q.mean()) < 0.01
    d = w["language_model.model.layers.0.mlp.switch_mlp.down_proj.weight"]
    assert abs(d.std() * np.sqrt(512) - 0.25) < 0.03
    g = w["language_model.model.layers.0.mlp.gate.weight"]  # 8-bit
    assert abs(g.std() * np.sqrt(256) - 1.0) < 0.1


def test_finite_through_40_layers_in_mlx(tmp_path):
    out = tmp_path / "deep"
    info = synth.synthesize(out, "qwen3.6-35b-a3b", sets=["hidden_size=128", "num_experts=8", "vocab_size=512",
                                                          "linear_num_key_heads=2", "linear_num_value_heads=4",
                                                          "num_attention_heads=8", "num_key_value_heads=1"],
                            progress=False, seed=3)
    assert info["layers"] == 40
    logits = mlx_forward(out, np.random.default_rng(0).integers(0, 256, 24))
    assert np.isfinite(logits).all()
    assert 1.5 < logits.std(axis=-1).mean() < 5.0  # lm_head tuned for logit std ~3


def test_deterministic(tmp_path):
    args = ["--config", "qwen3.6-35b-a3b", "--set", "hidden_size=128", "--set", "num_experts=4",
            "--set", "vocab_size=300", "--layers", "4", "-q", "--seed", "7"]
    assert synth.main([str(tmp_path / "a"), *args]) == 0
    assert synth.main([str(tmp_path / "b"), *args]) == 0
    assert (tmp_path / "a/model.safetensors").read_bytes() == (tmp_path / "b/model.safetensors").read_bytes()


def test_sharding(tmp_path):
    out = tmp_path / "sh"
    synth.synthesize(out, "qwen3.6-35b-a3b", sets=["hidden_size=128", "num_experts=8", "vocab_size=512"], layers=4,
                     shard_bytes=300_000, progress=False)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert np.isfinite(mlx_forward(out, [1, 2, 3])).all()


def test_full_size_plan_matches_the_spec():
    tensors, q = synth.plan(synth.load_config(None))
    assert sum(t.nbytes for t in tensors) == 19_508_789_376  # architecture.md §10.1
    assert len([k for k in q if k.startswith("language_model.")]) == 80
    hf, _ = synth.plan(synth.load_config(None), fmt="hf")
    assert sum(t.nbytes for t in hf) == 34_660_610_688 * 2 + 30 * 32 * 2  # bf16, A_log in F32


def test_full_width_one_layer(tmp_path):
    """The real widths (248320-row vocab, 256 experts) with --layers 1: about 1.05 GB written in seconds."""
    out = tmp_path / "full1"
    assert synth.main([str(out), "--layers", "1", "-q"]) == 0
    h = headers(out)
    p = "language_model.model.layers.0."
    assert h["language_model.model.embed_tokens.weight"] == ("U32", (248320, 256))
    assert h["language_model.lm_head.scales"] == ("BF16", (248320, 32))
    assert h[p + "mlp.switch_mlp.gate_proj.weight"] == ("U32", (256, 512, 256))
    assert h[p + "mlp.switch_mlp.down_proj.biases"] == ("BF16", (256, 2048, 8))
    assert h[p + "mlp.gate.weight"] == ("U32", (256, 512))
    assert h[p + "linear_attn.conv1d.weight"] == ("BF16", (8192, 4, 1))
    assert h[p + "linear_attn.A_log"] == ("F32", (32,))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["text_config"]["num_hidden_layers"] == 1 and cfg["text_config"]["hidden_size"] == 2048
    assert cfg["quantization"] == cfg["quantization_config"]
    assert sum(f.stat().st_size for f in out.glob("*.safetensors")) < 1.1e9
    logits = mlx_forward(out, [9707, 11, 1879])
    assert logits.shape == (3, 248320) and np.isfinite(logits).all()
    import lily

    eng = lily.Engine(str(out), backend="cpu", max_seq=64)
    ll = np.asarray(eng.prefill([9707, 11, 1879], all_logits=True))
    assert ll.shape == (3, 248320) and np.isfinite(ll).all()
    assert (ll.argmax(-1) == logits.argmax(-1)).mean() >= 2 / 3


def test_cli_errors(tmp_path, capsys):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x.txt").write_text("keep me")
    assert synth.main([str(tmp_path / "busy"), "--layers", "1"]) == 2
    assert synth.main([str(tmp_path / "busy"), "--layers", "1", "--force"]) == 2  # no config.json: not touched
    assert (tmp_path / "busy" / "x.txt").read_text() == "keep me"
    with pytest.raises(SystemExit) as ei:  # an option value argparse refuses
        synth.main([str(tmp_path / "a"), "--layers", "0"])
    assert ei.value.code == 2
    assert synth.main([str(tmp_path / "a"), "--set", "oops"]) == 2
    assert synth.main([str(tmp_path / "a"), "--config", str(tmp_path / "missing.json")]) == 2
    assert synth.main([str(tmp_path / "a"), "--bits", "7"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("lily synth: error:") == 6
    assert synth.main([str(tmp_path / "a"), "--dry-run"]) == 0
    assert "19,508,789,376 bytes" in capsys.readouterr().out


@pytest.mark.parametrize("vocab", [512, 248320])
def test_a_synthetic_checkpoint_works_with_every_command(tmp_path, vocab):
    """With the small vocabulary, lily's byte-level tokenizer; with the real one, the Qwen3.6 tokenizer shipped
    in the package: both with Qwen3.6's chat template, so generate, chat and the server's chat endpoint work
    (the tokenizer never reads a folder outside the package)."""
    import subprocess
    import sys

    import lily
    from conftest import TINY_SYNTH
    from lily.tokenizer_files import QWEN_VOCAB, qwen_chat_template
    from server_helpers import http, running

    out = tmp_path / "s"
    info = synth.synthesize(out, None, layers=4, sets=[*TINY_SYNTH, f"vocab_size={vocab}"], progress=False)
    assert info["tokenizer"] == ("Qwen3.6 (shipped with lily)" if vocab >= QWEN_VOCAB else "byte-level")
    assert (out / "chat_template.jinja").read_text() == qwen_chat_template()
    model = lily.load(out, backend="cpu")
    assert len(model.tokenizer) == (QWEN_VOCAB if vocab >= QWEN_VOCAB else 265) <= vocab
    eos = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    assert model.eos_ids == set(eos) and model.tokenizer.id_to_token(eos[0]) == "<|im_end|>"
    reply = model.chat([{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0)
    assert reply.stats.generated_tokens >= 1 and reply.finish_reason in ("stop", "length")
    for cmd in (["generate", str(out), "Hi"], ["chat", str(out)]):
        r = subprocess.run([sys.executable, "-m", "lily", *cmd, "--backend", "cpu", "--max-tokens", "3"],
                           input="Hi\n", capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "error" not in r.stderr and "tok/s" in r.stderr, r.stderr
    with running(model) as server:
        status, _, body = http(server, "POST", "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert status == 200 and json.loads(body)["choices"][0]["message"]["role"] == "assistant", body


# ---- --force over a checkpoint: written aside and renamed in (issue 17)


def _small(out, **kw):
    from conftest import TINY_SYNTH

    return synth.synthesize(out, None, layers=1, sets=TINY_SYNTH, progress=False, **kw)


def _files(folder) -> dict:
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}


def test_force_leaves_a_loaded_engine_reading_the_old_weights(tmp_path):
    """The new files are renamed over the old ones, so an engine that mapped the old ones reads them intact (a
    file rewritten in place would be refused, or kill the process with SIGBUS); a new load sees the new weights."""
    import lily

    out = tmp_path / "ckpt"
    _small(out, seed=0)
    eng = lily.Engine(out, backend="cpu", max_seq=64)
    before = eng.prefill([1, 2, 3])
    _small(out, seed=1, force=True)
    eng.reset()
    np.testing.assert_array_equal(eng.prefill([1, 2, 3]), before)
    after = lily.Engine(out, backend="cpu", max_seq=64).prefill([1, 2, 3])
    assert np.abs(after - before).max() > 1e-3


def test_failed_force_leaves_the_old_checkpoint(tmp_path):
    """A --force that fails part-way (here: a --tokenizer folder without a tokenizer, found after the weights
    were planned) used to delete the old checkpoint first; now nothing of it changes."""
    out = tmp_path / "ckpt"
    _small(out, seed=0)
    old = _files(out)
    (tmp_path / "empty").mkdir()
    with pytest.raises(synth.CommandError, match="no tokenizer.json"):
        _small(out, seed=1, force=True, tokenizer=tmp_path / "empty")
    assert _files(out) == old


def test_interrupted_force_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "ckpt"
    _small(out, seed=0)
    old = _files(out)
    write = synth.write_tensors

    def interrupted(folder, *args, **kwargs):
        write(folder, *args, **kwargs)
        raise KeyboardInterrupt  # Ctrl-C after the weights were written, before the rest

    monkeypatch.setattr(synth, "write_tensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _small(out, seed=1, force=True)
    assert _files(out) == old
    with pytest.raises(KeyboardInterrupt):  # a new folder is not left half-written either
        _small(tmp_path / "new", seed=1)
    assert not (tmp_path / "new").exists()


def test_force_removes_the_old_shards_the_new_checkpoint_has_not(tmp_path):
    import lily

    out = tmp_path / "ckpt"
    _small(out, seed=0, shard_bytes=1 << 20)
    assert len(list(out.glob("*.safetensors"))) > 1
    info = _small(out, seed=1, force=True)
    assert info["shards"] == 1 and sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    assert lily.Engine(out, backend="cpu", max_seq=8).prefill([1]).shape == (1024,)
