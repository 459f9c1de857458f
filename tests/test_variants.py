"""Other members of the family: configs that differ from both test presets in every dimension the
engine reads from config.json (odd widths, Dk != Dv, top-1 routing, Hv == Hk, attention every 2nd or
3rd layer, a 3-tap conv, 32 experts), each checked against MLX-LM like the presets, HF bf16 and a
4-bit group-32 conversion where mlx_lm can quantize it."""

from __future__ import annotations

import json

import fixtures
import numpy as np
import oracle
import pytest
from lily.tokenizer_files import write_byte_tokenizer

VARIANTS = {
    "odd": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=64,
                partial_rotary_factor=0.5, linear_num_key_heads=3, linear_num_value_heads=6,
                linear_key_head_dim=32, linear_value_head_dim=48, num_experts=5, num_experts_per_tok=3,
                moe_intermediate_size=40, shared_expert_intermediate_size=24, num_hidden_layers=6,
                full_attention_interval=3),
    "top1-conv3": dict(num_experts_per_tok=1, num_hidden_layers=4, linear_conv_kernel_dim=3),
    "gva1-interval2": dict(linear_num_value_heads=2, linear_num_key_heads=2, num_key_value_heads=1,
                           num_attention_heads=4, full_attention_interval=2, num_hidden_layers=4),
    "wide": dict(hidden_size=128, linear_key_head_dim=64, linear_value_head_dim=64, head_dim=128,
                 num_experts=32, num_experts_per_tok=8, moe_intermediate_size=64, num_hidden_layers=8),
}


def write_variant(folder, over: dict):
    folder.mkdir(parents=True)
    specials = write_byte_tokenizer(folder)
    cfg = fixtures.make_config("tiny", vocab_size=max(300, max(specials.values()) + 1))
    text = cfg["text_config"]
    over = dict(over)
    interval = over.pop("full_attention_interval", 4)
    rotary = over.pop("partial_rotary_factor", 0.25)
    text.update(over)
    text["full_attention_interval"] = interval
    text["layer_types"] = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(text["num_hidden_layers"])
    ]
    text["partial_rotary_factor"] = rotary
    text["rope_parameters"]["partial_rotary_factor"] = rotary
    (folder / "config.json").write_text(json.dumps(cfg))
    fixtures.write_weights(folder, fixtures.make_weights(cfg, 7))
    return text["vocab_size"]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_matches_mlx_lm(lily, tmp_path, name):
    hf = tmp_path / "hf"
    vocab = write_variant(hf, VARIANTS[name])
    folders = [hf]
    # mlx_lm keeps the router at 8-bit group 64 whatever the group asked for: needs hidden % 64 == 0.
    if VARIANTS[name].get("hidden_size", 64) % 64 == 0:
        folders.append(fixtures.convert_mlx(hf, tmp_path / "q4", bits=4, group_size=32))
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, vocab, 100)]
    for folder in folders:
        ref = oracle.mlx_logits(folder, tokens)
        eng = lily.Engine(folder, backend="cpu", kv_dtype="f32")  # the fp32 oracle's tolerance
        ours = eng.prefill(tokens, all_logits=True)
        err = float(np.abs(ours - ref).max())
        assert err <= 1e-3, f"{name} {folder.name}: max |dlogit| {err:.2e}"
        assert (ours.argmax(-1) == ref.argmax(-1)).all(), f"{name} {folder.name}: top-1 differs"
        eng.reset()
        split = np.concatenate([eng.prefill(tokens[:33], all_logits=True), eng.prefill(tokens[33:], all_logits=True)])
        assert np.abs(split - ours).max() <= 1e-4, f"{name} {folder.name}: split prefill"
