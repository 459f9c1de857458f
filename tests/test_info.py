"""``lily.info()`` and ``lily info``: what the machine gives Lily, and whether a checkpoint fits a backend's
memory at a ``max_seq`` (the check loading makes). On Linux: the CPU and the Metal simulator, whose GPU
working set ``LILY_METAL_SIM_WORKING_SET`` plays a small GPU (the check needs no shader compiled)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys

import pytest
from lily.command import worker_env


def test_system_info(lily):
    r = lily.info()
    assert r["version"] == "0.1.0"
    assert r["os"]
    assert set(r["auto"]) == {"backend", "reason", "fallback"}
    assert r["auto"]["reason"]
    if sys.platform == "darwin":
        # A Mac: either a Metal GPU with its description, or the reason there is none (whether that may be is
        # test_metal_device_is_found's question).
        assert ("device" in r["metal"]) != ("error" in r["metal"])
        if "device" in r["metal"]:
            assert r["auto"]["backend"] == "metal" and not r["auto"]["fallback"]
    else:
        assert r["auto"] == {"backend": "cpu", "reason": r["auto"]["reason"], "fallback": False}
        assert sys.platform in r["auto"]["reason"] or "linux" in r["auto"]["reason"]
        assert "no Metal" in r["metal"]["error"]


# How the Metal probe words "Metal lists no device at all" (crates/lily-core/src/backend/metal/device.rs find_gpu).
NO_METAL_DEVICE = "no Metal device:"


def _in_virtual_machine() -> bool:
    out = subprocess.run(["sysctl", "-n", "kern.hv_vmm_present"], capture_output=True, text=True, check=False)
    return out.stdout.strip() == "1"


def test_metal_device_is_found(lily):
    """On a Mac, ``lily.info()`` finds a Metal GPU Lily runs on (family Apple7+, unified memory, a working set) and
    "auto" picks it. Skipped only where there is no Metal device at all: off macOS, or in a macOS virtual machine
    that lists none (unless ``LILY_REQUIRE_METAL=1``). A Mac with a Metal device Lily cannot run on (a virtual
    machine's paravirtual GPU, as on GitHub's hosted runners; an Intel Mac's GPU) fails with the reason, and so does
    Mac hardware whose GPU is not found (discovery broken: every Mac that runs macOS 13 has a Metal GPU). The hosted
    macOS workflow leaves it out with the Rust device tests (``-k "not metal_device"``)."""
    r = lily.info()
    metal = r["metal"]
    if "device" not in metal:
        why = metal["error"]
        if sys.platform != "darwin":
            pytest.skip(f"no Metal device off macOS: {why}")
        vm = _in_virtual_machine()
        if why.startswith(NO_METAL_DEVICE) and vm and os.environ.get("LILY_REQUIRE_METAL") != "1":
            pytest.skip(f"no Metal device at all in this virtual machine: {why}")
        pytest.fail(f"this Mac ({platform.machine()}, virtual machine: {vm}) has no Metal GPU Lily runs on: {why}")
    assert r["auto"]["backend"] == "metal" and not r["auto"]["fallback"], r["auto"]
    family = re.match(r"Apple(\d+) ", metal["gpu_family"])  # "Apple9 (M3/M4)"
    assert family is not None and int(family.group(1)) >= 7, metal
    assert metal["recommended_max_working_set_size"] > 1 << 30, metal
    assert metal["unified_memory"] is True, metal


def test_checkpoint_fits_on_the_cpu_as_the_engine_loads_it(lily, tiny_hf):
    r = lily.info(tiny_hf, backend="cpu", max_seq=64)["checkpoint"]
    assert r["fits"] and r["backend"] == "cpu" and r["limit"] is None
    assert r["max_seq"] == 64 and r["kv_dtype"] == "bf16" and r["note"] is None
    b = r["bytes"]
    assert b["total"] == b["weights"] + b["delta_net_state"] + b["kv_cache"] + b["activations"]
    assert b["weights"] > 0 and b["kv_cache"] > 0
    # f32 keys and values: twice the bytes of bf16 ones.
    r32 = lily.info(tiny_hf, backend="cpu", max_seq=64, kv_dtype="f32")["checkpoint"]
    assert r32["bytes"]["kv_cache"] == 2 * b["kv_cache"]
    eng = lily.Engine(str(tiny_hf), backend="cpu")
    default = lily.info(tiny_hf, backend="cpu")["checkpoint"]
    assert default["max_seq"] == eng.max_seq


def test_checkpoint_fit_on_a_small_gpu(lily, tiny_hf, monkeypatch):
    full = lily.info(tiny_hf, backend="metal-sim")["checkpoint"]
    assert full["fits"] and full["limit"] is None
    max_seq, total, kv = full["max_seq"], full["bytes"]["total"], full["bytes"]["kv_cache"]
    # A GPU with room for about half the context's KV cache.
    monkeypatch.setenv("LILY_METAL_SIM_WORKING_SET", str(total - kv // 2))
    fitted = lily.info(tiny_hf, backend="metal-sim")["checkpoint"]
    assert fitted["fits"] and fitted["limit"] == total - kv // 2
    assert "recommendedMaxWorkingSetSize" in fitted["limit_is"]
    assert 0 < fitted["max_seq"] < max_seq
    assert fitted["bytes"]["total"] <= fitted["limit"]
    assert "max_seq fitted to the device" in fitted["note"]
    over = lily.info(tiny_hf, backend="metal-sim", max_seq=max_seq)["checkpoint"]
    assert not over["fits"]
    assert f"max_seq {fitted['max_seq']:,} or less fits" in over["error"]
    # Loading says the same.
    with pytest.raises(lily.DeviceError, match=f"max_seq {fitted['max_seq']:,} or less fits"):
        lily.Engine(str(tiny_hf), backend="metal-sim", max_seq=max_seq)


def test_bad_arguments(lily, tiny_hf, tmp_path):
    with pytest.raises(ValueError, match="backend"):
        lily.info(tiny_hf, backend="tpu")
    with pytest.raises(ValueError, match="max_seq"):
        lily.info(tiny_hf, max_seq=0)
    with pytest.raises(ValueError, match="kv_dtype"):
        lily.info(tiny_hf, kv_dtype="int8")
    with pytest.raises(lily.ModelLoadError):
        lily.info(tmp_path)


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "lily", "info", *args], capture_output=True, text=True,
                          env={**worker_env(), **(env or {})}, timeout=120)


def test_cli(tiny_hf):
    r = _cli()
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("lily 0.1.0\n")
    assert 'backend "auto": ' in r.stdout
    r = _cli(str(tiny_hf), "--backend", "metal-sim", "--max-seq", "64")
    assert r.returncode == 0, r.stderr
    assert "fits at max_seq 64" in r.stdout and "bf16 KV cache" in r.stdout
    # Too small a GPU: said, and the exit status says it.
    r = _cli(str(tiny_hf), "--backend", "metal-sim", "--max-seq", "64", env={"LILY_METAL_SIM_WORKING_SET": "1000"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "DOES NOT FIT" in r.stdout and "not even one token" in r.stdout
    r = _cli("/nonexistent-checkpoint")
    assert r.returncode == 2 and "not a checkpoint folder" in r.stderr
    r = _cli(str(tiny_hf), "--max-seq", "0")
    assert r.returncode == 2 and "--max-seq" in r.stderr


def test_auto_falling_back_to_the_cpu_warns_once(lily, tiny_hf, monkeypatch):
    """Where "auto" passes over a GPU backend (a Mac whose Metal GPU is not found), loading says so once, with
    the reason; elsewhere (the CPU is simply what this machine has) it says nothing."""
    import warnings

    import lily.loading as loading

    reason = "CPU: no Metal GPU of family Apple7 or later (a test)"
    monkeypatch.setattr(loading, "_warned_fallback", False)
    monkeypatch.setattr(loading._lily, "system_info",
                        lambda: {"auto": {"backend": "cpu", "reason": reason, "fallback": True}})
    with pytest.warns(RuntimeWarning, match="a test"):
        lily.load(tiny_hf, max_seq=64, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lily.load(tiny_hf, max_seq=64, progress=False)
    monkeypatch.setattr(loading, "_warned_fallback", False)
    monkeypatch.setattr(loading._lily, "system_info",
                        lambda: {"auto": {"backend": "cpu", "reason": "CPU: Linux", "fallback": False}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lily.load(tiny_hf, max_seq=64, progress=False)


def test_copied_weights_are_counted_and_reported(lily, tiny_hf):
    """Weights the Metal backend cannot read in place (not 4-byte aligned in their file) are copied: counted in
    ``copied_weight_bytes`` and said in ``notes``; the CPU reads every tensor in place."""
    import json
    import struct

    want = 0
    for shard in sorted(tiny_hf.glob("*.safetensors")):
        raw = shard.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        for name, t in json.loads(raw[8:8 + n]).items():
            a, b = t["data_offsets"] if name != "__metadata__" else (0, 0)
            if b > a and (8 + n + a) % 4:
                want += b - a
    assert lily.Engine(str(tiny_hf), backend="cpu", max_seq=64).copied_weight_bytes == 0
    eng = lily.Engine(str(tiny_hf), backend="metal-sim", max_seq=64)
    assert eng.copied_weight_bytes == want
    assert any("of weights copied to the device" in n for n in eng.notes) == (want > 0)
