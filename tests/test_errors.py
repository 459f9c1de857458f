"""Typed errors of ``lily.Engine`` and its small API surface (reset, position, max_seq, config, backend).

Load problems raise ``lily.ModelLoadError``; bad token ids, empty prompts and unknown backend names raise
``ValueError``; a full context raises ``lily.ContextFullError``. A failed call must leave the engine as it
was: the next valid call gives the same logits as on a fresh engine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys

import fixtures
import numpy as np
import pytest

TINY = fixtures.PRESETS["tiny"]
D = TINY["hidden_size"]
HV = TINY["linear_num_value_heads"]
MAX_SEQ = 32


@pytest.fixture
def ckpt_copy(tmp_path, tiny_hf):
    """A private, writable copy of the tiny HF checkpoint."""
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_hf, dst)
    return dst


def _load(lily, path, **kw):
    kw.setdefault("backend", "cpu")
    kw.setdefault("max_seq", MAX_SEQ)
    return lily.Engine(str(path), **kw)


def _edit_config(folder, edit):
    f = folder / "config.json"
    cfg = json.loads(f.read_text())
    edit(cfg)
    f.write_text(json.dumps(cfg))


def _vocab(tiny_hf):
    return json.loads((tiny_hf / "config.json").read_text())["text_config"]["vocab_size"]


# --------------------------------------------------------------------------------------------------
# exception classes


def test_exception_hierarchy(lily):
    for cls in (lily.ModelLoadError, lily.ContextFullError, lily.DeviceError, lily.SequenceEvictedError):
        assert issubclass(cls, lily.LilyError), cls
    assert issubclass(lily.LilyError, Exception)
    assert not issubclass(lily.ModelLoadError, lily.ContextFullError)


# --------------------------------------------------------------------------------------------------
# load errors


def test_missing_folder(lily, tmp_path):
    with pytest.raises(lily.ModelLoadError) as ei:
        _load(lily, tmp_path / "does-not-exist")
    assert "does-not-exist" in str(ei.value)


def test_offline_repo_id_is_one_clear_error(tmp_path):
    """A repo id that is not cached, with the Hub unreachable: the ModelLoadError says what to do, with no
    chained huggingface_hub / httpx traceback in front of it."""
    import subprocess

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    r = subprocess.run([sys.executable, "-c", "import lily; lily.load('some-org/some-model')"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("lily.ModelLoadError: some-org/some-model: not in the Hugging Face cache"), r.stderr
    assert "hf download some-org/some-model" in last and str(tmp_path / "hf") in last
    assert "During handling" not in r.stderr and "direct cause" not in r.stderr, r.stderr
    assert r.stderr.count("Traceback") == 1 and len(r.stderr.splitlines()) < 15, r.stderr
    cli = subprocess.run([sys.executable, "-m", "lily", "generate", "some-org/some-model", "hi"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 1 and len(cli.stderr.strip().splitlines()) == 1, cli.stderr
    assert cli.stderr.startswith("lily generate: error: some-org/some-model: not in the Hugging Face cache")


def test_missing_config(lily, ckpt_copy):
    (ckpt_copy / "config.json").unlink()
    with pytest.raises(lily.ModelLoadError, match="config"):
        _load(lily, ckpt_copy)


def test_config_not_json(lily, ckpt_copy):
    (ckpt_copy / "config.json").write_text("{not json")
    with pytest.raises(lily.ModelLoadError, match="config"):
        _load(lily, ckpt_copy)


@pytest.mark.parametrize("where", ["top", "text_config"])
def test_unknown_model_type(lily, ckpt_copy, where):
    def edit(cfg):
        (cfg if where == "top" else cfg["text_config"])["model_type"] = "llama_unknown"

    _edit_config(ckpt_copy, edit)
    with pytest.raises(lily.ModelLoadError, match="llama_unknown"):
        _load(lily, ckpt_copy)


@pytest.mark.parametrize("field", ["num_experts_per_tok", "hidden_size", "num_key_value_heads", "rms_norm_eps"])
def test_config_missing_field(lily, ckpt_copy, field):
    _edit_config(ckpt_copy, lambda cfg: cfg["text_config"].pop(field))
    with pytest.raises(lily.ModelLoadError) as ei:
        _load(lily, ckpt_copy)
    assert field in str(ei.value), f"message does not name `{field}`: {ei.value}"


def test_config_wrong_field_type(lily, ckpt_copy):
    _edit_config(ckpt_copy, lambda cfg: cfg["text_config"].__setitem__("num_experts", "many"))
    with pytest.raises(lily.ModelLoadError, match="num_experts"):
        _load(lily, ckpt_copy)


def test_corrupt_safetensors_header(lily, ckpt_copy):
    f = ckpt_copy / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[8:40] = b"#" * 32  # the JSON header is no longer JSON
    f.write_bytes(bytes(raw))
    with pytest.raises(lily.ModelLoadError, match="model.safetensors"):
        _load(lily, ckpt_copy)


def test_safetensors_header_length_past_eof(lily, ckpt_copy):
    f = ckpt_copy / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[:8] = struct.pack("<Q", len(raw) * 4)
    f.write_bytes(bytes(raw))
    with pytest.raises(lily.ModelLoadError, match="model.safetensors"):
        _load(lily, ckpt_copy)


def test_truncated_safetensors(lily, ckpt_copy):
    f = ckpt_copy / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[: len(raw) - 1000])
    with pytest.raises(lily.ModelLoadError, match="model.safetensors"):
        _load(lily, ckpt_copy)


def test_no_weight_files(lily, ckpt_copy):
    (ckpt_copy / "model.safetensors").unlink()
    with pytest.raises(lily.ModelLoadError):
        _load(lily, ckpt_copy)


def _rewrite(folder, edit):
    f = folder / "model.safetensors"
    tensors, meta = fixtures.read_safetensors(f)
    edit(tensors)
    fixtures.write_safetensors(f, tensors, meta)


def test_wrong_tensor_shape(lily, ckpt_copy):
    name = "model.language_model.layers.1.linear_attn.in_proj_a.weight"

    def edit(t):
        dt, arr = t[name]
        assert arr.shape == (HV, D)
        t[name] = (dt, np.concatenate([arr, arr[:1]], axis=0))  # [HV + 1, D]

    _rewrite(ckpt_copy, edit)
    with pytest.raises(lily.ModelLoadError) as ei:
        _load(lily, ckpt_copy)
    msg = str(ei.value)
    assert "layers.1.linear_attn.in_proj_a" in msg, f"message does not name the tensor: {msg}"
    for what, shape in (("expected", (HV, D)), ("found", (HV + 1, D))):
        pat = rf"\b{shape[0]}\D{{1,4}}{shape[1]}\b"
        assert re.search(pat, msg), f"message does not give the {what} shape {list(shape)}: {msg}"


def test_wrong_expert_tensor_shape(lily, ckpt_copy):
    name = "model.language_model.layers.3.mlp.experts.gate_up_proj"

    def edit(t):
        dt, arr = t[name]
        t[name] = (dt, arr[:, : arr.shape[1] // 2])  # gate only, no up half

    _rewrite(ckpt_copy, edit)
    with pytest.raises(lily.ModelLoadError) as ei:
        _load(lily, ckpt_copy)
    assert "layers.3.mlp.experts.gate_up_proj" in str(ei.value), str(ei.value)


@pytest.mark.parametrize("name", ["model.language_model.layers.2.linear_attn.dt_bias",
                                  "model.language_model.layers.3.self_attn.k_norm.weight", "lm_head.weight"])
def test_missing_tensor(lily, ckpt_copy, name):
    _rewrite(ckpt_copy, lambda t: t.pop(name))
    with pytest.raises(lily.ModelLoadError) as ei:
        _load(lily, ckpt_copy)
    short = name.removeprefix("model.language_model.").removesuffix(".weight")
    assert short in str(ei.value), f"message does not name {short}: {ei.value}"


def test_overlapping_tensors_are_refused(lily, ckpt_copy):
    """A tensor whose bytes lie inside another's (a norm pointing into the embedding) loads as garbage
    unless refused: the format forbids overlaps and requires the ranges to tile the data."""
    f = ckpt_copy / "model.safetensors"
    raw = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    name = "model.language_model.norm.weight"
    emb = header["model.language_model.embed_tokens.weight"]["data_offsets"]
    size = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
    header[name]["data_offsets"] = [emb[0], emb[0] + size]
    h = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n :])
    with pytest.raises(lily.ModelLoadError, match="overlap"):
        _load(lily, ckpt_copy)


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="no FIFOs on this OS")
def test_fifo_shard_does_not_hang(ckpt_copy):
    """Opening a FIFO blocks until a writer comes: the loader must refuse it without opening it.
    Run in a child process so a regression fails the test instead of hanging the suite."""
    import os
    import subprocess

    f = ckpt_copy / "model.safetensors"
    f.unlink()
    os.mkfifo(f)
    code = f"import lily; lily.Engine({str(ckpt_copy)!r}, backend='cpu', max_seq=8)"
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("Engine() blocked on a FIFO shard")
    assert r.returncode != 0 and "ModelLoadError" in r.stderr and "not a regular file" in r.stderr, r.stderr


def _conv_taps_1(folder, prefix_from=None, prefix_to=None):
    """Make the checkpoint's conv1d weights [C, 1, 1] (one tap), optionally renaming the tensor prefix."""
    f = folder / "model.safetensors"
    tensors, meta = fixtures.read_safetensors(f)
    out = {}
    for name, (dt, arr) in tensors.items():
        if name.endswith("linear_attn.conv1d.weight"):
            arr = arr[..., -1:]
        if prefix_from and name.startswith(prefix_from):
            name = prefix_to + name[len(prefix_from) :]
        out[name] = (dt, arr)
    fixtures.write_safetensors(f, out, meta)
    _edit_config(folder, lambda cfg: cfg["text_config"].__setitem__("linear_conv_kernel_dim", 1))


def test_norm_convention_from_other_marks_when_conv_is_ambiguous(lily, ckpt_copy):
    """With one conv tap, HF [C, 1, 1] and MLX [C, 1, 1] look the same; the HF prefix and fused experts
    still say Hugging Face, so the checkpoint loads."""
    _conv_taps_1(ckpt_copy)
    _load(lily, ckpt_copy).prefill([1, 2, 3])


def test_norm_convention_with_conflicting_marks_is_refused(lily, ckpt_copy):
    """MLX's prefix with Hugging Face's fused experts and an ambiguous conv: adding 1 to the norms or not
    would be a guess, so loading fails and names the marks."""
    _conv_taps_1(ckpt_copy, "model.language_model.", "language_model.model.")
    with pytest.raises(lily.ModelLoadError, match="1 \\+ w") as ei:
        _load(lily, ckpt_copy)
    assert "language_model.model." in str(ei.value) and "gate_up_proj" in str(ei.value)


@pytest.mark.parametrize("theta", [1e-40, 0.5, 1e39])
def test_rope_theta_that_cannot_work(lily, ckpt_copy, theta):
    _edit_config(ckpt_copy, lambda cfg: cfg["text_config"]["rope_parameters"].__setitem__("rope_theta", theta))
    with pytest.raises(lily.ModelLoadError, match="rope_theta"):
        _load(lily, ckpt_copy)


def test_config_dims_that_overflow(lily, ckpt_copy):
    _edit_config(ckpt_copy, lambda cfg: cfg["text_config"].__setitem__("vocab_size", 4_000_000_000))
    with pytest.raises(lily.ModelLoadError, match="2\\^32"):
        _load(lily, ckpt_copy)


def test_checkpoint_rewritten_in_place_after_load(lily, ckpt_copy):
    """A shard truncated and rewritten under a loaded engine would kill the process with SIGBUS on the
    next read of its map; the engine notices the change first and raises."""
    eng = _load(lily, ckpt_copy)
    eng.prefill([1, 2, 3])
    f = ckpt_copy / "model.safetensors"
    data = f.read_bytes()
    with open(f, "r+b") as fh:  # same file, new contents of the same length
        fh.write(data[:8])
        fh.flush()
    import os

    st = os.stat(f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(lily.ModelLoadError, match="modified on disk"):
        eng.decode(4)


def test_extreme_values_never_reach_a_panic(lily, tiny_hf):
    """Every public call with extreme values raises a Python exception of a documented kind; none is a
    Rust panic (pyo3's PanicException, a BaseException) and the engine stays usable."""
    eng = _load(lily, tiny_hf)
    vocab = eng.vocab_size
    calls = [
        lambda: eng.prefill([2**32 - 1]),
        lambda: eng.prefill([2**40]),
        lambda: eng.prefill([-1]),
        lambda: eng.prefill([vocab]),
        lambda: eng.prefill([]),
        lambda: eng.prefill([1] * (MAX_SEQ + 1)),
        lambda: eng.prefill("not tokens"),
        lambda: eng.prefill([1.5]),
        lambda: eng.decode(2**32),
        lambda: eng.decode(-(2**63)),
        lambda: eng.decode(vocab),
        lambda: eng.restore(None),
        lambda: lily.Engine(str(tiny_hf), backend="cpu", max_seq=2**64),
        lambda: lily.Engine(str(tiny_hf), backend="cpu", max_seq=-1),
        lambda: lily.Engine(str(tiny_hf), backend="cpu", max_seq=8, prefill_chunk=2**64),
        lambda: lily.Engine(str(tiny_hf), backend="cpu", max_seq=8, prefill_chunk=-(2**40)),
        lambda: lily.Engine(str(tiny_hf), backend="\x00" * 10_000),
        lambda: lily.Engine("\x00"),
    ]
    for i, call in enumerate(calls):
        # Each is refused with a typed error (an Exception); a panic (PanicException derives from
        # BaseException) or a call that goes through fails the test.
        try:
            call()
        except Exception:
            continue
        except BaseException as e:
            pytest.fail(f"call {i} raised {type(e).__name__}: {e}")
        pytest.fail(f"call {i} was accepted")
    assert eng.position == 0
    eng.prefill([1, 2, 3])
    assert eng.position == 3


def test_wrong_tensor_dtype(lily, ckpt_copy):
    name = "model.language_model.layers.0.input_layernorm.weight"
    _rewrite(ckpt_copy, lambda t: t.__setitem__(name, ("I32", t[name][1].astype(np.int32))))
    with pytest.raises(lily.ModelLoadError, match="layers.0.input_layernorm"):
        _load(lily, ckpt_copy)


def test_unknown_backend(lily, tiny_hf):
    with pytest.raises(ValueError, match="tpu"):
        _load(lily, tiny_hf, backend="tpu")


@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_unavailable_backend_is_device_error(lily, tiny_hf, backend):
    """No Metal device off macOS (or on a Mac without a Metal GPU), no CUDA device without an NVIDIA driver. Where
    ``lily.info()`` finds a Metal GPU, backend="metal" loads on it."""
    if backend == "metal" and "device" in lily.info()["metal"]:
        assert _load(lily, tiny_hf, backend=backend).backend == "metal"
        return
    if backend == "cuda" and any(os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/nvidiactl")):
        pytest.skip("an NVIDIA driver is installed: tests/test_cuda_device.py and cuda_device.rs cover it")
    with pytest.raises(lily.DeviceError):
        _load(lily, tiny_hf, backend=backend)


# --------------------------------------------------------------------------------------------------
# runtime errors leave the engine usable


@pytest.fixture(scope="module")
def fresh_logits(lily, tiny_hf):
    """Reference: the logits of a fresh engine after prefilling ``tokens``."""
    cache = {}

    def get(tokens):
        key = tuple(tokens)
        if key not in cache:
            eng = _load(lily, tiny_hf)
            cache[key] = eng.prefill(list(tokens), all_logits=True)
        return cache[key]

    return get


PROMPT = [5, 17, 300, 2, 99, 256, 7]


def _assert_still_works(eng, fresh_logits, history):
    """The engine holds ``history``; a following decode must match a fresh engine exactly (<= 1e-5)."""
    assert eng.position == len(history), f"position {eng.position}, expected {len(history)} after a failed call"
    nxt = 42
    got = eng.decode(nxt)
    ref = fresh_logits([*history, nxt])[-1]
    err = float(np.abs(got - ref).max())
    assert err <= 1e-4, f"after the error the engine's logits differ from a fresh engine's: max|Δ|={err:.3e}"


@pytest.mark.parametrize("bad", ["vocab", "vocab+1000", "negative", "huge"])
def test_bad_token_ids_raise_value_error(lily, tiny_hf, fresh_logits, bad):
    vocab = _vocab(tiny_hf)
    tok = {"vocab": vocab, "vocab+1000": vocab + 1000, "negative": -1, "huge": 2**40}[bad]
    eng = _load(lily, tiny_hf)
    with pytest.raises(ValueError):
        eng.prefill([tok])
    assert eng.position == 0
    eng.prefill(PROMPT)
    with pytest.raises(ValueError):
        eng.prefill([1, 2, tok, 3])  # the bad id in the middle: nothing of this call may be applied
    with pytest.raises(ValueError):
        eng.decode(tok)
    _assert_still_works(eng, fresh_logits, PROMPT)


def test_last_valid_token_id_is_accepted(lily, tiny_hf):
    vocab = _vocab(tiny_hf)
    eng = _load(lily, tiny_hf)
    out = eng.prefill([0, vocab - 1])
    assert out.shape == (vocab,) and np.isfinite(out).all()


def test_empty_prompt(lily, tiny_hf, fresh_logits):
    eng = _load(lily, tiny_hf)
    with pytest.raises(ValueError):
        eng.prefill([])
    with pytest.raises(ValueError):
        eng.prefill([], all_logits=True)
    assert eng.position == 0
    eng.prefill(PROMPT)
    with pytest.raises(ValueError):
        eng.prefill([])
    _assert_still_works(eng, fresh_logits, PROMPT)


def test_prompt_longer_than_max_seq(lily, tiny_hf, fresh_logits):
    eng = _load(lily, tiny_hf)
    assert eng.max_seq == MAX_SEQ
    with pytest.raises(lily.ContextFullError):
        eng.prefill(list(range(MAX_SEQ + 1)))
    assert eng.position == 0
    eng.prefill(PROMPT)
    with pytest.raises(lily.ContextFullError):
        eng.prefill(list(range(MAX_SEQ - len(PROMPT) + 1)))  # one token too many on top of PROMPT
    _assert_still_works(eng, fresh_logits, PROMPT)
    # exactly filling the context is fine
    eng.reset()
    out = eng.prefill(list(range(MAX_SEQ)))
    assert eng.position == MAX_SEQ and out.shape == (_vocab(tiny_hf),)


def test_decode_past_max_seq(lily, tiny_hf, fresh_logits):
    eng = _load(lily, tiny_hf)
    hist = list(range(3, 3 + MAX_SEQ - 1))
    eng.prefill(hist)
    eng.decode(1)  # the last free slot
    hist.append(1)
    assert eng.position == MAX_SEQ
    with pytest.raises(lily.ContextFullError):
        eng.decode(2)
    with pytest.raises(lily.ContextFullError):
        eng.prefill([2])
    assert eng.position == MAX_SEQ
    eng.reset()
    assert eng.position == 0
    _assert_still_works(eng, fresh_logits, [])


def test_context_full_is_a_lily_error(lily, tiny_hf):
    eng = _load(lily, tiny_hf, max_seq=4)
    with pytest.raises(lily.LilyError):
        eng.prefill([1, 2, 3, 4, 5])


# --------------------------------------------------------------------------------------------------
# API surface


def test_engine_attributes_and_reset(lily, tiny_hf, fresh_logits):
    eng = _load(lily, tiny_hf)
    assert eng.backend == "cpu"
    assert eng.max_seq == MAX_SEQ
    assert eng.position == 0
    cfg = eng.config
    assert isinstance(cfg, dict)
    on_disk = json.loads((tiny_hf / "config.json").read_text())
    assert cfg.get("model_type") == on_disk["model_type"]
    assert cfg.get("text_config", cfg)["hidden_size"] == on_disk["text_config"]["hidden_size"]
    assert cfg.get("text_config", cfg)["vocab_size"] == on_disk["text_config"]["vocab_size"]

    a = eng.prefill(PROMPT, all_logits=True)
    assert eng.position == len(PROMPT)
    eng.decode(11)
    assert eng.position == len(PROMPT) + 1
    eng.reset()
    assert eng.position == 0
    b = eng.prefill(PROMPT, all_logits=True)
    err = float(np.abs(a - b).max())
    assert err == 0.0 or err <= 1e-6, f"after reset() the same prompt gives different logits: max|Δ|={err:.3e}"
    np.testing.assert_allclose(b, fresh_logits(PROMPT), rtol=0, atol=1e-6)


def test_auto_backend_on_cpu_only_box(lily, tiny_hf):
    eng = _load(lily, tiny_hf, backend="auto")
    assert eng.backend == "cpu"


def test_default_max_seq(lily, tiny_hf):
    eng = lily.Engine(str(tiny_hf), backend="cpu")
    mpe = json.loads((tiny_hf / "config.json").read_text())["text_config"]["max_position_embeddings"]
    assert isinstance(eng.max_seq, int) and 0 < eng.max_seq <= mpe


def test_invalid_max_seq(lily, tiny_hf):
    with pytest.raises(ValueError):
        _load(lily, tiny_hf, max_seq=0)
    # Positions reach the kernels as 32-bit integers: a larger max_seq is refused up front.
    with pytest.raises(ValueError, match="max_seq"):
        lily.Engine(str(tiny_hf), backend="cpu", max_seq=2**32)
    # Past what Python's int converts to a size: a Python error, never a Rust panic.
    with pytest.raises((OverflowError, ValueError, TypeError)):
        lily.Engine(str(tiny_hf), backend="cpu", max_seq=2**70)


def test_prefill_chunk(lily, tiny_hf):
    assert _load(lily, tiny_hf).prefill_chunk == min(1024, MAX_SEQ)  # the CPU backend's default
    assert _load(lily, tiny_hf, prefill_chunk=5).prefill_chunk == 5
    assert _load(lily, tiny_hf, max_seq=8, prefill_chunk=100).prefill_chunk == 8
    for bad in (0, -3):
        with pytest.raises(ValueError, match="prefill_chunk"):
            _load(lily, tiny_hf, prefill_chunk=bad)


def test_engines_are_independent(lily, tiny_hf, fresh_logits):
    e1 = _load(lily, tiny_hf)
    e2 = _load(lily, tiny_hf)
    e1.prefill([9, 9, 9, 9])
    e2.prefill(PROMPT)
    _assert_still_works(e2, fresh_logits, PROMPT)
