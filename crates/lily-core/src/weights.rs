//! Checkpoint quirks, handled once at load so `model/` reads like the math:
//! - tensor prefixes: Hugging Face `model.language_model.*` + `lm_head.*`, MLX
//!   `language_model.model.*` + `language_model.lm_head.*`, or a bare text model `model.*`;
//! - zero-centred RMSNorm weights: HF stores w (the model uses 1 + w), MLX stores 1 + w already;
//!   told apart by the conv1d shape, HF [C, 1, K] vs MLX [C, K, 1] (mlx-lm's own test), and by
//!   the other marks of a conversion where that shape is ambiguous ([`detect_layout`]);
//! - experts: HF fused `experts.gate_up_proj` [E, 2I, D] (gate rows first) + `experts.down_proj`,
//!   MLX split `switch_mlp.{gate,up,down}_proj`;
//! - MLX affine quantization: `X.weight` (u32) + `X.scales` + `X.biases`, bits and group size
//!   resolved per module from the config's `quantization` block and checked against the shapes.
//!
//! Vision-tower and MTP tensors are never looked up.

use std::path::Path;

use crate::{
    config::{LayerKind, ModelConfig, Quantization},
    error::{Error, Result},
    quant::{float_format, shape_error, Format, Groups, Matrix},
    safetensors::{DType, FileWatch, SafeTensors, TensorView},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    HuggingFace,
    Mlx,
}

/// Whether the zero-centred norms hold w (Hugging Face) or 1 + w (MLX). mlx-lm's own test is the
/// conv1d shape, HF [C, 1, K] vs MLX [C, K, 1], decisive when K > 1. With K = 1 (both [C, 1, 1]) or
/// no DeltaNet layer the shape says nothing, and the other marks of a conversion must agree: the
/// tensor prefix (MLX `language_model.model.`, HF `model.language_model.`), the experts (MLX split
/// `switch_mlp`, HF fused `experts.gate_up_proj`) and quantization (only MLX files are quantized).
/// Guessing wrong adds 1 to every norm weight or forgets to, so no evidence, or evidence that
/// disagrees, is an error rather than a default.
fn detect_layout(st: &SafeTensors, prefix: &str, cfg: &ModelConfig) -> Result<Layout> {
    let delta_net = cfg.layer_types.iter().position(|k| *k == LayerKind::DeltaNet);
    if let Some(t) = delta_net.and_then(|i| st.get(&format!("{prefix}layers.{i}.linear_attn.conv1d.weight"))) {
        match t.shape.as_slice() {
            [_, 1, k] if *k > 1 => return Ok(Layout::HuggingFace),
            [_, k, 1] if *k > 1 => return Ok(Layout::Mlx),
            _ => {} // [C, 1, 1], or a wrong shape that `conv` reports
        }
    }
    let mut marks: Vec<(Layout, &str)> = Vec::new();
    match prefix {
        "model.language_model." => marks.push((Layout::HuggingFace, "tensor prefix `model.language_model.`")),
        "language_model.model." => marks.push((Layout::Mlx, "tensor prefix `language_model.model.`")),
        _ => {}
    }
    if st.contains(&format!("{prefix}layers.0.mlp.switch_mlp.gate_proj.weight")) {
        marks.push((Layout::Mlx, "split experts `mlp.switch_mlp.*`"));
    }
    if st.contains(&format!("{prefix}layers.0.mlp.experts.gate_up_proj")) {
        marks.push((Layout::HuggingFace, "fused experts `mlp.experts.gate_up_proj`"));
    }
    if st.contains(&format!("{prefix}embed_tokens.scales")) {
        marks.push((Layout::Mlx, "quantized tensors"));
    }
    let says = |l: Layout| marks.iter().filter(|m| m.0 == l).map(|m| m.1).collect::<Vec<_>>();
    match (says(Layout::HuggingFace).as_slice(), says(Layout::Mlx).as_slice()) {
        ([_, ..], []) => Ok(Layout::HuggingFace),
        ([], [_, ..]) => Ok(Layout::Mlx),
        ([], []) => Err(Error::Config(
            "cannot tell whether this checkpoint's RMSNorm weights hold w (Hugging Face) or 1 + w (MLX): \
             its conv1d shape, tensor prefix and expert layout carry no mark of either"
                .into(),
        )),
        (hf, mlx) => Err(Error::Config(format!(
            "the checkpoint mixes Hugging Face marks ({}) with MLX marks ({}): cannot tell whether its \
             RMSNorm weights hold w or 1 + w",
            hf.join(", "),
            mlx.join(", ")
        ))),
    }
}

pub struct Loader<'a> {
    st: SafeTensors,
    cfg: &'a ModelConfig,
    /// Prefix of the text model's tensors (`model.language_model.` etc.).
    prefix: String,
    lm_head: String,
    pub layout: Layout,
}

impl<'a> Loader<'a> {
    pub fn open(dir: &Path, cfg: &'a ModelConfig) -> Result<Self> {
        let st = SafeTensors::open_dir(dir)?;
        let prefix = ["model.language_model.", "language_model.model.", "model."]
            .into_iter()
            .find(|p| st.contains(&format!("{p}embed_tokens.weight")))
            .ok_or_else(|| {
                Error::weight(
                    "embed_tokens.weight",
                    "missing (looked for model.language_model.embed_tokens.weight, language_model.model.embed_tokens.weight, model.embed_tokens.weight)",
                )
            })?
            .to_string();
        let lm_head = if cfg.tie_word_embeddings {
            format!("{prefix}embed_tokens")
        } else {
            ["lm_head", "language_model.lm_head"]
                .into_iter()
                .find(|p| st.contains(&format!("{p}.weight")))
                .ok_or_else(|| Error::weight("lm_head.weight", "missing (and tie_word_embeddings is false)"))?
                .to_string()
        };
        let layout = detect_layout(&st, &prefix, cfg)?;
        Ok(Loader {
            st,
            cfg,
            prefix,
            lm_head,
            layout,
        })
    }

    /// The files behind the mapped weights (to check that they are unchanged before use).
    pub fn watch(&self) -> FileWatch {
        self.st.watch()
    }

    /// Bytes of the tensors the model reads: the text model's embedding, final norm and
    /// `num_hidden_layers` layers, and the lm_head (vision-tower and MTP tensors, and layers a
    /// config leaves out, are not read and take no memory).
    pub fn weight_bytes(&self) -> u64 {
        let layers = self.cfg.num_hidden_layers;
        let read = |name: &str| {
            let Some(rest) = name.strip_prefix(self.prefix.as_str()) else {
                return name
                    .strip_prefix(self.lm_head.as_str())
                    .is_some_and(|r| r.starts_with('.'));
            };
            match rest.strip_prefix("layers.") {
                Some(r) => r
                    .split('.')
                    .next()
                    .and_then(|i| i.parse::<usize>().ok())
                    .is_some_and(|i| i < layers),
                None => rest.starts_with("embed_tokens.") || rest.starts_with("norm."),
            }
        };
        self.st
            .tensors()
            .filter(|t| read(&t.name))
            .map(|t| t.bytes.len() as u64)
            .sum()
    }

    fn full(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// A linear weight of logical shape [rows, cols] (`name` without `.weight`, under the text prefix).
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        self.matrix_at(&self.full(name), &[], rows, cols)
    }

    pub fn embed(&self) -> Result<Matrix> {
        self.matrix("embed_tokens", self.cfg.vocab_size, self.cfg.hidden_size)
    }

    pub fn lm_head(&self) -> Result<Matrix> {
        let name = self.lm_head.clone();
        self.matrix_at(&name, &[], self.cfg.vocab_size, self.cfg.hidden_size)
    }

    /// A full module path `base` (without `.weight`) holding `[lead.., rows, cols]`.
    fn matrix_at(&self, base: &str, lead: &[usize], rows: usize, cols: usize) -> Result<Matrix> {
        let w = self.st.require(&format!("{base}.weight"))?;
        let groups = match self.st.get(&format!("{base}.scales")) {
            Some(scales) => Some((scales, self.st.require(&format!("{base}.biases"))?)),
            None => None,
        };
        matrix(base, w, groups, self.cfg.quantization.as_ref(), lead, rows, cols)
    }

    /// A float vector of `len` values.
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let full = self.full(name);
        let t = self.st.require(&full)?;
        if t.shape != [len] {
            return Err(shape_error(&full, &[len], &t.shape));
        }
        t.to_f32()
    }

    /// A zero-centred RMSNorm weight, returned as the multiplier 1 + w (already so in MLX files).
    pub fn norm(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let mut w = self.vector(name, len)?;
        if self.layout == Layout::HuggingFace {
            w.iter_mut().for_each(|x| *x += 1.0);
        }
        Ok(w)
    }

    /// Depthwise conv weight as [channels, taps]: HF [C, 1, K] and MLX [C, K, 1] share this memory order.
    pub fn conv(&self, name: &str, channels: usize, taps: usize) -> Result<Vec<f32>> {
        let full = self.full(name);
        let t = self.st.require(&full)?;
        let expected = match self.layout {
            Layout::HuggingFace => [channels, 1, taps],
            Layout::Mlx => [channels, taps, 1],
        };
        if t.shape != expected {
            return Err(shape_error(&full, &expected, &t.shape));
        }
        t.to_f32()
    }

    /// Routed experts of layer `i` as (gate [E, I, D], up [E, I, D], down [E, D, I]).
    pub fn experts(&self, i: usize) -> Result<(Matrix, Matrix, Matrix)> {
        let (e, d, inter) = (
            self.cfg.num_experts,
            self.cfg.hidden_size,
            self.cfg.moe_intermediate_size,
        );
        let mlx = self.full(&format!("layers.{i}.mlp.switch_mlp"));
        if self.st.contains(&format!("{mlx}.gate_proj.weight")) {
            return Ok((
                self.matrix_at(&format!("{mlx}.gate_proj"), &[e], inter, d)?,
                self.matrix_at(&format!("{mlx}.up_proj"), &[e], inter, d)?,
                self.matrix_at(&format!("{mlx}.down_proj"), &[e], d, inter)?,
            ));
        }
        let hf = self.full(&format!("layers.{i}.mlp.experts"));
        let fused = format!("{hf}.gate_up_proj");
        let Some(t) = self.st.get(&fused) else {
            return Err(Error::weight(
                &fused,
                format!("missing (and no MLX `{mlx}.gate_proj.weight`; per-expert tensors are not supported)"),
            ));
        };
        if t.shape != [e, 2 * inter, d] {
            return Err(shape_error(&fused, &[e, 2 * inter, d], &t.shape));
        }
        let format = float_format(&fused, t.dtype, &t.dtype_name)?;
        // Gate rows 0..I and up rows I..2I of each expert: two views of one stored tensor.
        let half = |row_offset| Matrix {
            name: fused.clone(),
            format,
            experts: e,
            rows: inter,
            cols: d,
            expert_stride: 2 * inter,
            row_offset,
            data: t.bytes.clone(),
            groups: None,
        };
        let down_name = format!("{hf}.down_proj");
        let dt = self.st.require(&down_name)?;
        if dt.shape != [e, d, inter] {
            return Err(shape_error(&down_name, &[e, d, inter], &dt.shape));
        }
        let down_format = float_format(&down_name, dt.dtype, &dt.dtype_name)?;
        let down = Matrix::whole(down_name, down_format, [e, d, inter], dt.bytes.clone(), None);
        Ok((half(0), half(inter), down))
    }
}

/// The weight `base.weight` of logical shape `[lead.., rows, cols]`: dense (F32 / F16 / BF16), or
/// MLX affine-quantized when `groups` holds its `.scales` and `.biases`, with bits and group size
/// from the config's `quantization` block. Every shape and dtype is checked against the others, so
/// a `Matrix` that comes back can be read in full (every row of every expert) within its bytes.
pub fn matrix(
    base: &str,
    w: &TensorView,
    groups: Option<(&TensorView, &TensorView)>,
    quantization: Option<&Quantization>,
    lead: &[usize],
    rows: usize,
    cols: usize,
) -> Result<Matrix> {
    let wname = format!("{base}.weight");
    let experts = lead
        .iter()
        .try_fold(1usize, |a, &x| a.checked_mul(x))
        .ok_or_else(|| Error::weight(&wname, "expert count overflows"))?;
    if experts == 0 {
        // A zero leading dimension holds no bytes; the matrix would still be read as one expert.
        return Err(Error::weight(
            &wname,
            format!("a leading (expert) dimension is 0: {lead:?}"),
        ));
    }
    let expected: Vec<usize> = lead.iter().copied().chain([rows, cols]).collect();
    let sname = format!("{base}.scales");
    let Some((scales, biases)) = groups else {
        let format = float_format(&wname, w.dtype, &w.dtype_name)?;
        if w.shape != expected {
            return Err(shape_error(&wname, &expected, &w.shape));
        }
        return Ok(Matrix::whole(
            wname,
            format,
            [experts.max(1), rows, cols],
            w.bytes.clone(),
            None,
        ));
    };
    let q = quantization.ok_or_else(|| {
        Error::weight(
            &wname,
            "is quantized (has .scales) but config.json has no `quantization` block",
        )
    })?;
    let spec = q.spec_for(base);
    let group = spec.group_size;
    if w.dtype != DType::U32 {
        return Err(Error::weight(
            &wname,
            format!("quantized weight must be U32, found {}", w.dtype_name),
        ));
    }
    if !matches!(scales.dtype, DType::F32 | DType::F16 | DType::BF16) || scales.dtype != biases.dtype {
        return Err(Error::weight(
            &sname,
            format!(
                "scales {} / biases {} must be one float dtype",
                scales.dtype_name, biases.dtype_name
            ),
        ));
    }
    if cols == 0 || cols % group != 0 || (cols * spec.bits as usize) % 32 != 0 {
        return Err(Error::weight(
            &wname,
            format!(
                "input dim {cols} must be a positive multiple of group size {group} that packs into 32-bit words at {} bits",
                spec.bits
            ),
        ));
    }
    let groups_shape: Vec<usize> = lead.iter().copied().chain([rows, cols / group]).collect();
    if scales.shape != groups_shape {
        return Err(Error::weight(
            &sname,
            format!(
                "expected shape {groups_shape:?} (group size {group} from config), found {:?}",
                scales.shape
            ),
        ));
    }
    if biases.shape != groups_shape {
        return Err(shape_error(&format!("{base}.biases"), &groups_shape, &biases.shape));
    }
    let packed = w.shape.last().copied().unwrap_or(0);
    let bits = packed * 32 / cols;
    let packed_shape: Vec<usize> = lead
        .iter()
        .copied()
        .chain([rows, cols * spec.bits as usize / 32])
        .collect();
    if bits != spec.bits as usize || w.shape != packed_shape {
        return Err(Error::weight(
            &wname,
            format!(
                "expected packed shape {packed_shape:?} ({} bits from config, logical [{rows}, {cols}]), found {:?}",
                spec.bits, w.shape
            ),
        ));
    }
    let groups = Groups {
        dtype: scales.dtype,
        scales: scales.bytes.clone(),
        biases: biases.bytes.clone(),
    };
    Ok(Matrix::whole(
        wname,
        Format::Affine { bits: spec.bits, group },
        [experts.max(1), rows, cols],
        w.bytes.clone(),
        Some(groups),
    ))
}
