"""Shared session fixtures: random checkpoints (HF bf16, sharded, MLX-quantized) and cached MLX-LM logits.

Checkpoints and reference logits are cached on disk in ``tests/.fixtures/`` (gitignored; override with
``$LILY_TEST_FIXTURES``). The cache key includes the source of ``fixtures.py``/``oracle.py`` and the
mlx / mlx-lm versions, so editing the generator or upgrading mlx rebuilds everything. Nothing is
skipped: if mlx or mlx-lm is missing, every test that needs the oracle fails (CI installs them).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

# Property tests (hypothesis): a few seconds each by default; HYPOTHESIS_PROFILE=long runs many more examples.
settings.register_profile("ci", max_examples=300, deadline=None)
settings.register_profile("long", max_examples=30_000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import fixtures  # noqa: E402

FIXTURE_ROOT = Path(os.environ.get("LILY_TEST_FIXTURES", HERE / ".fixtures"))
SEQ_LEN = 192  # teacher-forced positions compared with the oracle

# name -> write_hf_checkpoint keyword arguments
HF_CHECKPOINTS = {
    "tiny-s0": dict(preset="tiny", seed=0),
    "tiny-s1-theta1e3": dict(preset="tiny", seed=1, rope_theta=1000.0),
    "real-s0": dict(preset="real_heads", seed=0),
    "real-s1-theta1e4": dict(preset="real_heads", seed=1, rope_theta=10000.0),
    "tiny-s2-3shards": dict(preset="tiny", seed=2, shards=3),
    "real-s2-2shards": dict(preset="real_heads", seed=2, shards=2, rope_theta=1000.0),
    # Long contexts (the 16-bit KV cache past 8K tokens, tests/test_kv_cache.py).
    "tiny-s3-long": dict(preset="tiny", seed=3, max_position_embeddings=32768),
}
# name -> (HF source name, bits, group_size)
MLX_CHECKPOINTS = {
    "tiny-s0-q4g64": ("tiny-s0", 4, 64),
    "real-s0-q4g64": ("real-s0", 4, 64),
    "real-s1-q4g64": ("real-s1-theta1e4", 4, 64),
    "tiny-s1-q8g32": ("tiny-s1-theta1e3", 8, 32),
    "real-s0-q8g32": ("real-s0", 8, 32),
    "real-s0-q4g128": ("real-s0", 4, 128),
    "real-s1-q4g128": ("real-s1-theta1e4", 4, 128),
}
ALL_CHECKPOINTS = [*HF_CHECKPOINTS, *MLX_CHECKPOINTS]


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "missing"


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


# the test checkpoints' tokenizers come from lily.tokenizer_files
_FIXTURES_SRC = (HERE / "fixtures.py").read_text() + (HERE.parent / "python/lily/tokenizer_files.py").read_text()
_ORACLE_SRC = (HERE / "oracle.py").read_text() + (HERE.parent / "python/lily/mlx_reference.py").read_text()


def require_mlx():
    """Import mlx + mlx-lm or fail the test loudly (they are test requirements, never skipped)."""
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except Exception as e:  # pragma: no cover - environment problem
        pytest.fail(f"mlx[cpu] and mlx-lm are required by the test suite (tests/requirements.txt): {e!r}",
                    pytrace=False)


def _build_atomic(target: Path, build) -> Path:
    """Run ``build(tmp_dir)`` into a scratch folder, then rename it to ``target`` (safe under xdist)."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


class Checkpoints:
    """Lazily built, disk-cached test checkpoints, addressed by the names in HF_/MLX_CHECKPOINTS."""

    def __init__(self, root: Path):
        self.root = root
        self._paths: dict = {}

    def path(self, name: str) -> Path:
        if name in self._paths:
            return self._paths[name]
        if name in HF_CHECKPOINTS:
            kw = HF_CHECKPOINTS[name]
            target = self.root / f"{name}-{_digest(_FIXTURES_SRC, sorted(kw.items()))}"

            def build(tmp: Path):
                fixtures.write_hf_checkpoint(tmp / "ckpt", **kw)
                for f in (tmp / "ckpt").iterdir():
                    f.rename(tmp / f.name)
                (tmp / "ckpt").rmdir()

        elif name in MLX_CHECKPOINTS:
            src, bits, gs = MLX_CHECKPOINTS[name]
            src_path = self.path(src)
            target = self.root / f"{name}-{_digest(src_path.name, bits, gs, _version('mlx'), _version('mlx-lm'))}"
            require_mlx()

            def build(tmp: Path):
                fixtures.convert_mlx(src_path, tmp / "ckpt", bits=bits, group_size=gs)
                for f in (tmp / "ckpt").iterdir():
                    f.rename(tmp / f.name)
                (tmp / "ckpt").rmdir()

        else:
            raise KeyError(f"unknown test checkpoint {name!r}")
        self._paths[name] = _build_atomic(target, build)
        return self._paths[name]

    def config(self, name: str) -> dict:
        return json.loads((self.path(name) / "config.json").read_text())

    def vocab_size(self, name: str) -> int:
        cfg = self.config(name)
        return int(cfg.get("text_config", cfg)["vocab_size"])


class Oracle:
    """MLX-LM reference logits, cached in memory and on disk per (checkpoint, tokens, method)."""

    def __init__(self, ckpts: Checkpoints):
        self.ckpts = ckpts
        self._mem: dict = {}

    def _cached(self, method: str, name: str, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64)
        folder = self.ckpts.path(name)
        key = _digest(method, folder.name, tokens.tobytes(), _ORACLE_SRC, _version("mlx"), _version("mlx-lm"))
        if key in self._mem:
            return self._mem[key]
        f = self.ckpts.root / "oracle" / f"{name}-{method}-{key}.npy"
        if f.exists():
            out = np.load(f)
        else:
            require_mlx()
            import oracle

            out = getattr(oracle, method)(folder, tokens)
            f.parent.mkdir(parents=True, exist_ok=True)
            tmp = f.with_suffix(f".tmp{os.getpid()}.npy")
            np.save(tmp, out)
            os.replace(tmp, f)
        self._mem[key] = out
        return out

    def logits(self, name: str, tokens) -> np.ndarray:
        """Teacher-forced fp32 MLX-LM logits [T, vocab] (the oracle of test_oracle.py)."""
        return self._cached("mlx_logits", name, tokens)

    def dequantized_logits(self, name: str, tokens) -> np.ndarray:
        return self._cached("mlx_logits_dequantized", name, tokens)

    def decode_logits(self, name: str, tokens) -> np.ndarray:
        return self._cached("mlx_decode_logits", name, tokens)

    def numpy_logits(self, name: str, tokens) -> np.ndarray:
        """The independent float64 numpy forward pass of oracle.py (cross-checks MLX-LM itself)."""
        return self._cached("numpy_reference_logits", name, tokens)


def make_tokens(seed: int, n: int, vocab: int) -> np.ndarray:
    """Deterministic random token ids in [0, vocab) (padding rows included, they are valid ids)."""
    return np.random.default_rng(1000 + seed).integers(0, vocab, size=n).astype(np.int64)


@pytest.fixture(scope="session")
def ckpts() -> Checkpoints:
    return Checkpoints(FIXTURE_ROOT)


@pytest.fixture(scope="session")
def oracle_cache(ckpts) -> Oracle:
    return Oracle(ckpts)


@pytest.fixture(scope="session")
def lily():
    """The package under test (an ImportError here means the extension is not built: run maturin develop)."""
    import lily as mod

    return mod


@pytest.fixture(scope="session")
def tiny_hf(ckpts) -> Path:
    return ckpts.path("tiny-s0")


# `lily synth` overrides for a small checkpoint with the real per-head shapes (bench / eval tests).
TINY_SYNTH = ["hidden_size=256", "num_experts=16", "vocab_size=1024", "linear_num_key_heads=2",
              "linear_num_value_heads=4", "num_attention_heads=16", "num_key_value_heads=2",
              "moe_intermediate_size=128", "shared_expert_intermediate_size=128", "max_position_embeddings=4096"]


@pytest.fixture(scope="session")
def tiny_synth(tmp_path_factory) -> Path:
    """A 4-layer `lily synth` checkpoint (MLX 4-bit layout), written once per session."""
    from lily import synth

    out = tmp_path_factory.mktemp("synth") / "tiny"
    synth.synthesize(out, None, layers=4, sets=TINY_SYNTH, progress=False)
    return out
