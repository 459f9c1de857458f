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
        let rope_theta = match rope_field("rope_theta") {
            Some(v) => v
                .as_f64()
                .filter(|x| *x > 0.0)
                .ok_or_else(|| Error::Config(format!("`rope_theta` must be a positive number, found {v}")))?,
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
            Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
            _ => Vec::new(),
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
        if self.rms_norm_eps >= 1.0 {
            return bad(format!(
                "`rms_norm_eps` {} is not a small positive number",
                self.rms_norm_eps
            ));
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
