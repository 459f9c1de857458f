//! `config.json` of a Qwen3.5/3.6 MoE checkpoint (`model_type` `qwen3_5_moe` with a nested
//! `text_config`, or a bare `qwen3_5_moe_text`). Every dimension comes from the file; a missing
//! or wrong field is an error naming the field and the value found.

use std::path::Path;

use serde_json::{Map, Value};

use crate::{
    backend::params::MAX_CONV_TAPS,
    error::{Error, Result},
};

/// Token mixer of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet (`linear_attention`).
    DeltaNet,
    /// Gated full attention (`full_attention`).
    Attention,
}

/// MLX affine quantization of one module: `w = scale * q + bias`, groups along the input axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantSpec {
    pub bits: u32,
    pub group_size: usize,
}

#[derive(Clone, Debug)]
pub struct Quantization {
    pub default: QuantSpec,
    /// Per-module overrides keyed by module path (e.g. `language_model.model.layers.0.mlp.gate`).
    pub overrides: Vec<(String, QuantSpec)>,
}

impl Quantization {
    /// The spec for a module path, trying the path as written and without its `language_model.` prefix.
    pub fn spec_for(&self, module: &str) -> QuantSpec {
        let short = module.strip_prefix("language_model.").unwrap_or(module);
        for (path, spec) in &self.overrides {
            let p = path.strip_prefix("language_model.").unwrap_or(path);
            if p == short {
                return *spec;
            }
        }
        self.default
    }
}

/// The text decoder's configuration, in the names of the Hugging Face config.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub layer_types: Vec<LayerKind>,
    // gated full attention
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f64,
    pub partial_rotary_factor: f64,
    // Gated DeltaNet
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    // MoE
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    pub norm_topk_prob: bool,
    pub eos_token_ids: Vec<u32>,
    pub quantization: Option<Quantization>,
    /// The `config.json` as read, for `Engine.config`.
    pub raw: Value,
}

fn field<'a>(obj: &'a Map<String, Value>, name: &str) -> Result<&'a Value> {
    obj.get(name)
        .ok_or_else(|| Error::Config(format!("missing field `{name}`")))
}

fn usize_field(obj: &Map<String, Value>, name: &str) -> Result<usize> {
    let v = field(obj, name)?;
    match v.as_u64() {
        Some(n) if n > 0 && n <= u32::MAX as u64 => Ok(n as usize),
        _ => Err(Error::Config(format!(
            "field `{name}` must be a positive integer, found {v}"
        ))),
    }
}

fn f64_field(obj: &Map<String, Value>, name: &str) -> Result<f64> {
    let v = field(obj, name)?;
    match v.as_f64() {
        Some(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(Error::Config(format!(
            "field `{name}` must be a positive number, found {v}"
        ))),
    }
}

fn token_id(n: &serde_json::Number, name: &str) -> Result<u32> {
    n.as_u64()
        .and_then(|x| u32::try_from(x).ok())
        .ok_or_else(|| Error::Config(format!("`{name}` must hold token ids (integers >= 0), found {n}")))
}

fn bool_or(obj: &Map<String, Value>, name: &str, default: bool) -> Result<bool> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(Error::Config(format!(
            "field `{name}` must be true or false, found {v}"
        ))),
    }
}

fn quant_spec(v: &Value, what: &str) -> Result<QuantSpec> {
    let obj = v
        .as_object()
        .ok_or_else(|| Error::Config(format!("`{what}` must be an object, found {v}")))?;
    let bits = usize_field(obj, "bits").map_err(|e| Error::Config(format!("{what}: {e}")))? as u32;
    let group_size = usize_field(obj, "group_size").map_err(|e| Error::Config(format!("{what}: {e}")))?;
    if !matches!(bits, 2 | 4 | 8) {
        return Err(Error::Config(format!(
            "{what}: `bits` {bits} is not supported (2, 4 or 8)"
        )));
    }
    if !matches!(group_size, 32 | 64 | 128) {
        return Err(Error::Config(format!(
            "{what}: `group_size` {group_size} is not supported (32, 64 or 128)"
        )));
    }
    Ok(QuantSpec { bits, group_size })
}

fn parse_quantization(v: &Value) -> Result<Quantization> {
    let obj = v
        .as_object()
        .ok_or_else(|| Error::Config(format!("`quantization` must be an object, found {v}")))?;
    if let Some(mode) = obj.get("mode") {
        if mode.as_str() != Some("affine") {
            return Err(Error::Config(format!(
                "quantization `mode` {mode} is not supported (only \"affine\")"
            )));
        }
    }
    let default = quant_spec(v, "quantization")?;
    let mut overrides = Vec::new();
    for (key, val) in obj {
        if val.is_object() {
            overrides.push((key.clone(), quant_spec(val, &format!("quantization.{key}"))?));
        }
    }
    Ok(Quantization { default, overrides })
}

impl ModelConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::file(path, e))?;
        let raw: Value = serde_json::from_str(&text).map_err(|e| Error::file(path, format!("not valid JSON: {e}")))?;
        Self::from_json(raw)
    }

    pub fn from_json(raw: Value) -> Result<Self> {
        let top = raw
            .as_object()
            .ok_or_else(|| Error::Config("config.json must hold a JSON object".into()))?;
        let model_type = top.get("model_type").and_then(Value::as_str).unwrap_or("");
        let text = match model_type {
            "qwen3_5_moe" => {
                let tc = field(top, "text_config")?;
                let tc = tc
                    .as_object()
                    .ok_or_else(|| Error::Config(format!("`text_config` must be an object, found {tc}")))?;
                let inner = tc.get("model_type").and_then(Value::as_str);
                if inner.is_some() && inner != Some("qwen3_5_moe_text") {
                    return Err(Error::Config(format!(
                        "`text_config.model_type` must be \"qwen3_5_moe_text\", found {}",
                        tc["model_type"]
                    )));
                }
                tc
            }
            "qwen3_5_moe_text" => top,
            _ => {
                return Err(Error::Config(format!(
                    "`model_type` must be \"qwen3_5_moe\" or \"qwen3_5_moe_text\", found {}",
                    top.get("model_type").map_or("nothing".to_string(), |v| v.to_string())
                )))
            }
        };

        let num_hidden_layers = usize_field(text, "num_hidden_layers")?;
        let layer_types = match text.get("layer_types") {
            Some(Value::Array(kinds)) => {
                if kinds.len() != num_hidden_layers {
                    return Err(Error::Config(format!(
                        "`layer_types` has {} entries, `num_hidden_layers` is {num_hidden_layers}",
                        kinds.len()
                    )));
                }
                kinds
                    .iter()
                    .enumerate()
                    .map(|(i, k)| match k.as_str() {
                        Some("linear_attention") => Ok(LayerKind::DeltaNet),
                        Some("full_attention") => Ok(LayerKind::Attention),
                        _ => Err(Error::Config(format!(
                            "`layer_types[{i}]` must be \"linear_attention\" or \"full_attention\", found {k}"
                        ))),
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            Some(Value::Null) | None => {
                let every = usize_field(text, "full_attention_interval")?;
                (0..num_hidden_layers)
                    .map(|i| {
                        if (i + 1) % every == 0 {
                            LayerKind::Attention
                        } else {
                            LayerKind::DeltaNet
                        }
                    })
                    .collect()
            }
            Some(v) => return Err(Error::Config(format!("`layer_types` must be a list, found {v}"))),
        };

        // RoPE: `rope_parameters` (transformers >= 5) or the older top-level fields.
        let rope = text
            .get("rope_parameters")
            .and_then(Value::as_object)
            .or_else(|| text.get("rope_scaling").and_then(Value::as_object));
        let rope_field = |name: &str| -> Option<&Value> { rope.and_then(|r| r.get(name)).or_else(|| text.get(name)) };
        if let Some(kind) = rope.and_then(|r| r.get("rope_type").or_else(|| r.get("type"))) {
            if !matches!(kind.as_str(), Some("default") | Some("mrope")) {
                return Err(Error::Config(format!(
                    "`rope_type` {kind} is not supported (only \"default\")"
                )));
            }
        }
        // The kernels compute theta^(-2j / rotary_dim) in f32: a base at or below 1 (frequencies that
        // grow with j, or all equal) or one that is not a finite f32 would run to NaN angles.
        let rope_theta = match rope_field("rope_theta") {
            Some(v) => v
                .as_f64()
                .filter(|x| *x > 1.0 && (*x as f32).is_finite())
                .ok_or_else(|| {
                    Error::Config(format!(
                        "`rope_theta` must be a number above 1 that fits in f32 (Qwen3.6: 1e7), found {v}"
                    ))
                })?,
            None => {
                return Err(Error::Config(
                    "missing field `rope_theta` (in `rope_parameters` or the text config)".into(),
                ))
            }
        };
        let partial_rotary_factor = match rope_field("partial_rotary_factor") {
            Some(v) => v
                .as_f64()
                .filter(|x| *x > 0.0 && *x <= 1.0)
                .ok_or_else(|| Error::Config(format!("`partial_rotary_factor` must be in (0, 1], found {v}")))?,
            None => 1.0,
        };

        let hidden_act = text.get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
        if hidden_act != "silu" {
            return Err(Error::Config(format!(
                "`hidden_act` must be \"silu\", found \"{hidden_act}\""
            )));
        }
        if bool_or(text, "attention_bias", false)? {
            return Err(Error::Config(
                "`attention_bias` true is not supported by this model family".into(),
            ));
        }
        if !bool_or(text, "attn_output_gate", true)? {
            return Err(Error::Config(
                "`attn_output_gate` false is not supported by this model family".into(),
            ));
        }

        let eos_token_ids = match text.get("eos_token_id").or_else(|| top.get("eos_token_id")) {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Number(n)) => vec![token_id(n, "eos_token_id")?],
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::Number(n) => token_id(n, "eos_token_id"),
                    _ => Err(Error::Config(format!(
                        "`eos_token_id` entries must be token ids, found {v}"
                    ))),
                })
                .collect::<Result<Vec<_>>>()?,
            Some(v) => {
                return Err(Error::Config(format!(
                    "`eos_token_id` must be a token id or a list of them, found {v}"
                )))
            }
        };
        let quantization = match top.get("quantization").or_else(|| top.get("quantization_config")) {
            Some(q) => Some(parse_quantization(q)?),
            None => None,
        };
        let tie = match text.get("tie_word_embeddings") {
            Some(_) => bool_or(text, "tie_word_embeddings", false)?,
            None => bool_or(top, "tie_word_embeddings", false)?,
        };
        let cfg = ModelConfig {
            hidden_size: usize_field(text, "hidden_size")?,
            num_hidden_layers,
            vocab_size: usize_field(text, "vocab_size")?,
            rms_norm_eps: f64_field(text, "rms_norm_eps")? as f32,
            max_position_embeddings: usize_field(text, "max_position_embeddings")?,
            tie_word_embeddings: tie,
            layer_types,
            num_attention_heads: usize_field(text, "num_attention_heads")?,
            num_key_value_heads: usize_field(text, "num_key_value_heads")?,
            head_dim: usize_field(text, "head_dim")?,
            rope_theta,
            partial_rotary_factor,
            linear_num_key_heads: usize_field(text, "linear_num_key_heads")?,
            linear_num_value_heads: usize_field(text, "linear_num_value_heads")?,
            linear_key_head_dim: usize_field(text, "linear_key_head_dim")?,
            linear_value_head_dim: usize_field(text, "linear_value_head_dim")?,
            linear_conv_kernel_dim: usize_field(text, "linear_conv_kernel_dim")?,
            num_experts: usize_field(text, "num_experts")?,
            num_experts_per_tok: usize_field(text, "num_experts_per_tok")?,
            moe_intermediate_size: usize_field(text, "moe_intermediate_size")?,
            shared_expert_intermediate_size: usize_field(text, "shared_expert_intermediate_size")?,
            norm_topk_prob: bool_or(text, "norm_topk_prob", true)?,
            eos_token_ids,
            quantization,
            raw,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::Config(msg));
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return bad(format!(
                "`num_attention_heads` {} is not a multiple of `num_key_value_heads` {}",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if self.linear_num_value_heads % self.linear_num_key_heads != 0 {
            return bad(format!(
                "`linear_num_value_heads` {} is not a multiple of `linear_num_key_heads` {}",
                self.linear_num_value_heads, self.linear_num_key_heads
            ));
        }
        if self.num_experts_per_tok > self.num_experts {
            return bad(format!(
                "`num_experts_per_tok` {} exceeds `num_experts` {}",
                self.num_experts_per_tok, self.num_experts
            ));
        }
        let rot = self.rotary_dim();
        if rot == 0 || rot % 2 != 0 || rot > self.head_dim {
            return bad(format!(
                "`partial_rotary_factor` {} gives rotary dim {rot} for head_dim {}; it must be even and in 2..=head_dim",
                self.partial_rotary_factor, self.head_dim
            ));
        }
        if self.linear_conv_kernel_dim > MAX_CONV_TAPS {
            return bad(format!(
                "`linear_conv_kernel_dim` {} is more than the {MAX_CONV_TAPS} taps the conv kernels support",
                self.linear_conv_kernel_dim
            ));
        }
        // f64_field accepts any positive number; as f32 it must still be above 0 (1e-50 rounds to
        // 0, and a zero row would then normalise to NaN).
        if !(self.rms_norm_eps > 0.0 && self.rms_norm_eps < 1.0) {
            return bad(format!(
                "`rms_norm_eps` {} is not a small positive number (as f32)",
                self.rms_norm_eps
            ));
        }
        if let Some(&id) = self.eos_token_ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return bad(format!(
                "`eos_token_id` {id} is not a token of the {}-entry vocabulary",
                self.vocab_size
            ));
        }
        self.check_sizes()
    }

    /// Every tensor and state size derived from the config, in checked arithmetic: a product that
    /// overflows, or a tensor past the 2^32 - 1 elements the kernels index with 32-bit offsets, is
    /// a config error here instead of a wrapped size later.
    fn check_sizes(&self) -> Result<()> {
        let (d, v) = (self.hidden_size, self.vocab_size);
        let (h, kv, hd) = (self.num_attention_heads, self.num_key_value_heads, self.head_dim);
        let (hk, hv) = (self.linear_num_key_heads, self.linear_num_value_heads);
        let (dk, dv) = (self.linear_key_head_dim, self.linear_value_head_dim);
        let (e, i, is) = (
            self.num_experts,
            self.moe_intermediate_size,
            self.shared_expert_intermediate_size,
        );
        let taps = self.linear_conv_kernel_dim;
        let key_dim = hk.checked_mul(dk);
        let value_dim = hv.checked_mul(dv);
        let conv_dim = key_dim
            .and_then(|k| k.checked_mul(2))
            .and_then(|k| value_dim.and_then(|v| k.checked_add(v)));
        let sizes: [(&str, &[Option<usize>]); 12] = [
            ("embed_tokens / lm_head [vocab_size, hidden_size]", &[Some(v), Some(d)]),
            (
                "q_proj [2 * heads * head_dim, hidden_size]",
                &[Some(2), Some(h), Some(hd), Some(d)],
            ),
            (
                "k_proj / v_proj [kv_heads * head_dim, hidden_size]",
                &[Some(kv), Some(hd), Some(d)],
            ),
            ("o_proj [hidden_size, heads * head_dim]", &[Some(d), Some(h), Some(hd)]),
            ("in_proj_qkv [conv channels, hidden_size]", &[conv_dim, Some(d)]),
            (
                "in_proj_z / out_proj [value heads * value dim, hidden_size]",
                &[value_dim, Some(d)],
            ),
            (
                "DeltaNet state [value heads, key dim, value dim]",
                &[Some(hv), Some(dk), Some(dv)],
            ),
            ("conv state [taps, conv channels]", &[Some(taps), conv_dim]),
            (
                "experts gate_up [experts, 2 * moe_intermediate_size, hidden_size]",
                &[Some(e), Some(2), Some(i), Some(d)],
            ),
            (
                "experts down [experts, hidden_size, moe_intermediate_size]",
                &[Some(e), Some(d), Some(i)],
            ),
            (
                "shared expert [shared_expert_intermediate_size, hidden_size]",
                &[Some(is), Some(d)],
            ),
            ("router [experts, hidden_size]", &[Some(e), Some(d)]),
        ];
        for (what, dims) in sizes {
            let n = dims.iter().try_fold(1usize, |a, x| x.and_then(|x| a.checked_mul(x)));
            if n.is_none_or(|n| n > u32::MAX as usize) {
                return Err(Error::Config(format!(
                    "{what}: the config's dimensions make a tensor of more than 2^32 - 1 elements ({})",
                    n.map_or("overflow".to_string(), |n| n.to_string())
                )));
            }
        }
        Ok(())
    }

    /// Dimensions rotated by RoPE in each attention head (64 of 256 for Qwen3.6).
    pub fn rotary_dim(&self) -> usize {
        ((self.head_dim as f64) * self.partial_rotary_factor).round() as usize
    }
    /// DeltaNet q/k width: Hk * Dk.
    pub fn key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }
    /// DeltaNet v/z width: Hv * Dv.
    pub fn value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }
    /// Channels of the DeltaNet causal conv: [q | k | v].
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({
            "model_type": "qwen3_5_moe",
            "text_config": {
                "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 8,
                "vocab_size": 248320, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
                "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2,
                "head_dim": 256, "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
                "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256,
                "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                "eos_token_id": 248044
            }
        })
    }

    #[test]
    fn parses_nested_text_config() {
        let c = ModelConfig::from_json(base()).unwrap();
        assert_eq!(c.layer_types.iter().filter(|k| **k == LayerKind::Attention).count(), 2);
        assert_eq!(c.layer_types[3], LayerKind::Attention);
        assert_eq!(c.rotary_dim(), 64);
        assert_eq!(c.conv_dim(), 8192);
    }

    #[test]
    fn conv_wider_than_the_kernels_is_a_config_error() {
        let mut v = base();
        v["text_config"]["linear_conv_kernel_dim"] = json!(MAX_CONV_TAPS + 1);
        let e = ModelConfig::from_json(v).unwrap_err().to_string();
        assert!(e.contains("linear_conv_kernel_dim"), "{e}");
        let mut v = base();
        v["text_config"]["linear_conv_kernel_dim"] = json!(MAX_CONV_TAPS);
        assert!(ModelConfig::from_json(v).is_ok());
    }

    #[test]
    fn errors_name_the_field() {
        let mut v = base();
        v["text_config"]["head_dim"] = json!("big");
        let e = ModelConfig::from_json(v).unwrap_err().to_string();
        assert!(e.contains("head_dim") && e.contains("\"big\""), "{e}");
        let mut v = base();
        v["model_type"] = json!("llama");
        assert!(ModelConfig::from_json(v).unwrap_err().to_string().contains("llama"));
        let mut v = base();
        v["text_config"].as_object_mut().unwrap().remove("num_experts");
        assert!(ModelConfig::from_json(v)
            .unwrap_err()
            .to_string()
            .contains("num_experts"));
    }

    fn error_of(edit: impl FnOnce(&mut Value)) -> String {
        let mut v = base();
        edit(&mut v["text_config"]);
        match ModelConfig::from_json(v) {
            Ok(_) => panic!("config accepted"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn values_that_parse_but_cannot_be_right_are_refused() {
        // A RoPE base at or below 1, or past f32, would run to NaN angles.
        for theta in [json!(1e-40), json!(0.5), json!(1.0), json!(1e39)] {
            let e = error_of(|t| t["rope_parameters"]["rope_theta"] = theta.clone());
            assert!(e.contains("rope_theta"), "{e}");
        }
        // An eps that is 0 as f32.
        let e = error_of(|t| t["rms_norm_eps"] = json!(1e-50));
        assert!(e.contains("rms_norm_eps"), "{e}");
        // eos ids outside the vocabulary, or not ids at all.
        let e = error_of(|t| t["eos_token_id"] = json!([248044, 248320]));
        assert!(e.contains("eos_token_id") && e.contains("248320"), "{e}");
        let e = error_of(|t| t["eos_token_id"] = json!(["<|im_end|>"]));
        assert!(e.contains("eos_token_id"), "{e}");
        let e = error_of(|t| t["eos_token_id"] = json!(-1));
        assert!(e.contains("eos_token_id"), "{e}");
    }

    #[test]
    fn sizes_are_checked_arithmetic() {
        // Each field is a valid u32, their products are not: a config error, not a wrapped size.
        for (field, value) in [
            ("vocab_size", json!(4_000_000_000u64)),
            ("hidden_size", json!(3_000_000_000u64)),
            ("num_experts", json!(4_000_000_000u64)),
            ("linear_value_head_dim", json!(4_000_000_000u64)),
        ] {
            let e = error_of(|t| t[field] = value);
            assert!(e.contains("2^32"), "{field}: {e}");
        }
    }

    #[test]
    fn quantization_overrides() {
        let mut v = base();
        v["quantization"] = json!({"group_size": 64, "bits": 4, "mode": "affine",
            "language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}});
        let c = ModelConfig::from_json(v).unwrap();
        let q = c.quantization.unwrap();
        assert_eq!(q.spec_for("language_model.model.layers.0.mlp.gate").bits, 8);
        assert_eq!(q.spec_for("language_model.model.layers.1.mlp.gate").bits, 4);
    }
}
