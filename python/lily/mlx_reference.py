"""MLX-LM as the reference engine (``lily bench --compare mlx-lm``, ``lily eval``, the tests' oracle): load a
checkpoint folder into MLX-LM, as saved or with every float tensor in fp32, through MLX-LM's public API.

fp32 matters on a CPU: MLX's bf16 quantized matmul there is about 8x slower and off by several %. The
upcast happens before the model's ``sanitize`` (so load-time fixes such as the norms' ``1 + w`` of a
Hugging Face checkpoint are computed in fp32, not rounded to bf16) and again on the loaded parameters.
"""

from __future__ import annotations

import importlib
from pathlib import Path

__all__ = ["MLX_DTYPES", "default_dtype", "load_mlx_model", "model_classes", "upcast_to_float32"]

MLX_DTYPES = ("native", "float32")


def default_dtype() -> str:
    """fp32 on a CPU (the only precision at which MLX-LM is a usable reference there), as saved on a GPU."""
    import mlx.core as mx

    return "native" if mx.default_device() == mx.gpu else "float32"


def model_classes(config: dict, float32: bool):
    """MLX-LM's model and args classes for ``config`` (``mlx_lm.models.<model_type>``), the model's
    ``sanitize`` upcasting floats first when ``float32``."""
    import mlx.core as mx
    from mlx_lm.utils import MODEL_REMAPPING

    model_type = MODEL_REMAPPING.get(config["model_type"], config["model_type"])
    arch = importlib.import_module(f"mlx_lm.models.{model_type}")
    if not float32:
        return arch.Model, arch.ModelArgs

    class Fp32Model(arch.Model):
        def sanitize(self, weights):
            weights = {k: (v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v)
                       for k, v in weights.items()}
            return super().sanitize(weights)

    return Fp32Model, arch.ModelArgs


def upcast_to_float32(model) -> None:
    """Every floating parameter of ``model`` in fp32 (quantized codes untouched)."""
    import mlx.core as mx
    from mlx.utils import tree_map

    model.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))
    mx.eval(model.parameters())


def load_mlx_model(folder: str | Path, dtype: str = "native"):
    """``(model, config)`` of MLX-LM for the checkpoint ``folder``; ``dtype`` "float32" upcasts every float
    tensor (quantized codes untouched), "native" keeps them as saved."""
    from mlx_lm.utils import load_model

    if dtype not in MLX_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(MLX_DTYPES)}; got {dtype!r}")
    float32 = dtype == "float32"
    model, config = load_model(Path(folder), lazy=False, strict=True,
                               get_model_classes=lambda config: model_classes(config, float32))
    if float32:
        upcast_to_float32(model)
    # MLX-LM indexes the cache of layer full_attention_interval - 1 even when the model is shorter
    # (e.g. `lily synth --layers 2`); without full-attention layers there is no mask to build.
    text_model = model.language_model.model if hasattr(model, "language_model") else getattr(model, "model", None)
    if text_model is not None and getattr(text_model, "fa_idx", None) is not None \
            and text_model.fa_idx >= len(text_model.layers):
        text_model.fa_idx = None
    return model, config
