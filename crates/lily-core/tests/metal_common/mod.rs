//! What the Metal tests share beyond the kernel tests (`gpu_common`: the devices, `gpu_tests!`,
//! `both!`): matrices stored for views in every weight format, the every-kernel build, and a tiny
//! checkpoint end to end (`TinyCheckpoint`, written here in the MLX layout, also run by the CUDA
//! tests). A test crate that uses it declares `mod common; mod gpu_common;` too.

#![allow(dead_code)] // each test binary uses the subset it needs

use std::path::{Path, PathBuf};

use crate::common::{float_bytes, rand_vec};
use crate::gpu_common::assert_near;

use lily_core::{
    backend::{
        cpu::Cpu,
        metal::{Executor, GpuFamily, Metal, Variants},
        Backend, KvDtype, StreamKind,
    },
    config::ModelConfig,
    model::{
        state::{Scratch, State},
        Model,
    },
    safetensors::DType,
    weights::Loader,
};

/// Metal::new builds the kernels of its family's variants; the others are built on first use:
/// build every host name of kernels::kernel_names() (every variant) now.
pub fn every_kernel_is_compiled<X: Executor>(dev: &Metal<X>) {
    assert!(dev.name().starts_with("metal"), "{}", dev.name());
    dev.build_all_pipelines().unwrap();
    assert_eq!(dev.variants, Variants::for_family(dev.family()));
    eprintln!("{}", dev.describe());
}

// ---- End to end: a tiny checkpoint through the whole model ------------------------------------

/// One sequence's state on `b` with KV rows of `kv` and 64 positions reserved, and the scratch of
/// prefill chunks of up to 16 tokens: what the tiny checkpoint's runs use.
pub fn state_and_scratch<B: Backend>(b: &B, cfg: &ModelConfig, kv: KvDtype) -> (State<B>, Scratch<B>) {
    let mut state = State::new(b, cfg, 64, kv).unwrap();
    state.reserve(b, 64).unwrap();
    (state, Scratch::new(b, cfg, 64, 16).unwrap())
}

/// A tiny Qwen3.5-MoE checkpoint in the MLX layout, written to a fresh folder (removed on drop):
/// 2 layers (DeltaNet, then attention), D = 96, vocabulary 250, 8 experts (top 2, I = 64), every
/// matrix 4-bit group 32 with bf16 scales except the routers (`mlp.gate`,
/// `shared_expert_gate`: 8-bit overrides, as MLX writes them). Row counts leave partial tiles
/// for every variant (250-row lm_head and embedding, 4-row DeltaNet a/b projections, 1-row
/// shared-expert gate, 96-row output projections against 64-row tiles).
pub struct TinyCheckpoint {
    pub dir: PathBuf,
}

impl Drop for TinyCheckpoint {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One tensor for the safetensors writer: name, dtype, shape, little-endian bytes.
type Tensor = (String, &'static str, Vec<usize>, Vec<u8>);

/// `name` as an MLX affine-quantized matrix [lead.., rows, cols] (`.weight` u32, `.scales` and
/// `.biases` bf16): random codes, scales such that w has a standard deviation of about
/// `std`, centred on zero.
fn quantized(out: &mut Vec<Tensor>, name: &str, shape: &[usize], bits: usize, std: f32, seed: u64) {
    let (cols, group) = (shape[shape.len() - 1], 32);
    let lead: usize = shape[..shape.len() - 1].iter().product();
    let words = lead * cols * bits / 32;
    let codes: Vec<u8> = rand_vec(words, seed, 0.0, 1.0)
        .iter()
        .enumerate()
        .flat_map(|(i, v)| ((v * 4294967295.0) as u32 ^ (i as u32).wrapping_mul(2654435761)).to_le_bytes())
        .collect();
    // Uniform codes in [0, 2^bits): std (2^bits) / sqrt(12), mean (2^bits - 1) / 2.
    let levels = (1u32 << bits) as f32;
    let ng = lead * cols / group;
    let scales: Vec<f32> = rand_vec(ng, seed + 1, 0.7, 1.3)
        .iter()
        .map(|f| f * std * 12f32.sqrt() / levels)
        .collect();
    let biases: Vec<f32> = scales
        .iter()
        .zip(rand_vec(ng, seed + 2, -0.2, 0.2))
        .map(|(s, n)| -s * (levels - 1.0) / 2.0 + n * std)
        .collect();
    let mut wshape = shape.to_vec();
    *wshape.last_mut().unwrap() = cols * bits / 32;
    let mut gshape = shape.to_vec();
    *gshape.last_mut().unwrap() = cols / group;
    out.push((format!("{name}.weight"), "U32", wshape, codes));
    out.push((
        format!("{name}.scales"),
        "BF16",
        gshape.clone(),
        float_bytes(&scales, DType::BF16),
    ));
    out.push((
        format!("{name}.biases"),
        "BF16",
        gshape,
        float_bytes(&biases, DType::BF16),
    ));
}

fn f32_tensor(out: &mut Vec<Tensor>, name: &str, shape: &[usize], lo: f32, hi: f32, seed: u64) {
    let n = shape.iter().product();
    out.push((
        name.to_string(),
        "F32",
        shape.to_vec(),
        float_bytes(&rand_vec(n, seed, lo, hi), DType::F32),
    ));
}

/// A minimal safetensors writer: the JSON header (offsets in order, no holes), then the bytes.
/// 4-byte dtypes first, so every u32 / f32 tensor stays 4-byte aligned in the mapping.
fn write_safetensors(path: &Path, mut tensors: Vec<Tensor>) {
    tensors.sort_by_key(|t| t.1 == "BF16");
    let mut header = serde_json::Map::new();
    let mut at = 0;
    for (name, dtype, shape, bytes) in &tensors {
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [at, at + bytes.len()]}),
        );
        at += bytes.len();
    }
    let mut h = serde_json::Value::Object(header).to_string().into_bytes();
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&h);
    for (_, _, _, bytes) in &tensors {
        file.extend_from_slice(bytes);
    }
    std::fs::write(path, file).unwrap();
}

impl TinyCheckpoint {
    /// 2 layers: a DeltaNet layer, then an attention layer.
    pub fn write() -> TinyCheckpoint {
        Self::with_layers(2, 2)
    }

    /// An engine on this checkpoint through the public API: the CPU backend in `precision`, room
    /// for 256 positions.
    pub fn cpu_engine(&self, precision: lily_core::backend::cpu::int8::Precision) -> lily_core::engine::Engine {
        use lily_core::engine::{BackendKind, Engine, Options};
        let opts = Options {
            backend: BackendKind::Cpu,
            max_seq: Some(256),
            precision,
            ..Options::default()
        };
        Engine::load(&self.dir, &opts, &mut |_, _| Ok(())).unwrap()
    }

    /// `layers` layers, every `interval`-th one full attention and the others DeltaNet (the
    /// real model: 40 and 4), at the tiny dimensions.
    pub fn with_layers(layers: usize, interval: usize) -> TinyCheckpoint {
        Self::with_width(layers, interval, 96)
    }

    /// [`Self::with_layers`] with hidden size `d` (a multiple of 32): 96 leaves the CPU's
    /// hidden-input matrices to its 16-byte kernels; 384 gives them the x86 kernels' 2 x 64- and
    /// 3 x 128-element blocks (pairs of blocks and an odd last block in the fast precision).
    pub fn with_width(layers: usize, interval: usize, d: usize) -> TinyCheckpoint {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "lily-metal-tiny-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let v = 250usize;
        let (h, kv, hd) = (4usize, 2usize, 32usize);
        let (hk, hv, dk, dv, taps) = (2usize, 4usize, 32usize, 32usize, 4usize);
        let (e, inter, shared) = (8usize, 64usize, 64usize);
        let conv_dim = 2 * hk * dk + hv * dv;
        let mut overrides = serde_json::Map::new();
        for i in 0..layers {
            for m in ["mlp.gate", "mlp.shared_expert_gate"] {
                overrides.insert(
                    format!("language_model.model.layers.{i}.{m}"),
                    serde_json::json!({"group_size": 32, "bits": 8}),
                );
            }
        }
        let mut quant = serde_json::json!({"group_size": 32, "bits": 4, "mode": "affine"});
        quant.as_object_mut().unwrap().extend(overrides);
        let config = serde_json::json!({
            "model_type": "qwen3_5_moe",
            "text_config": {
                "model_type": "qwen3_5_moe_text", "hidden_size": d, "num_hidden_layers": layers,
                "vocab_size": v, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
                "full_attention_interval": interval, "num_attention_heads": h, "num_key_value_heads": kv,
                "head_dim": hd,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                "linear_num_key_heads": hk, "linear_num_value_heads": hv, "linear_key_head_dim": dk,
                "linear_value_head_dim": dv, "linear_conv_kernel_dim": taps, "num_experts": e,
                "num_experts_per_tok": 2, "moe_intermediate_size": inter,
                "shared_expert_intermediate_size": shared, "tie_word_embeddings": false
            },
            "quantization": quant,
        });
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();

        let mut t: Vec<Tensor> = Vec::new();
        let p = "language_model.model.";
        let std_in = |cols: usize| 1.0 / (cols as f32).sqrt();
        quantized(&mut t, &format!("{p}embed_tokens"), &[v, d], 4, 1.0, 1);
        quantized(&mut t, "language_model.lm_head", &[v, d], 4, 3.0 * std_in(d), 2);
        f32_tensor(&mut t, &format!("{p}norm.weight"), &[d], 0.8, 1.2, 3);
        for i in 0..layers {
            let l = format!("{p}layers.{i}.");
            let s = 100 * (i as u64 + 1);
            f32_tensor(&mut t, &format!("{l}input_layernorm.weight"), &[d], 0.8, 1.2, s);
            f32_tensor(
                &mut t,
                &format!("{l}post_attention_layernorm.weight"),
                &[d],
                0.8,
                1.2,
                s + 1,
            );
            if (i + 1) % interval != 0 {
                let a = format!("{l}linear_attn.");
                quantized(&mut t, &format!("{a}in_proj_qkv"), &[conv_dim, d], 4, std_in(d), s + 2);
                quantized(&mut t, &format!("{a}in_proj_z"), &[hv * dv, d], 4, std_in(d), s + 3);
                quantized(&mut t, &format!("{a}in_proj_b"), &[hv, d], 4, std_in(d), s + 4);
                quantized(&mut t, &format!("{a}in_proj_a"), &[hv, d], 4, std_in(d), s + 5);
                quantized(
                    &mut t,
                    &format!("{a}out_proj"),
                    &[d, hv * dv],
                    4,
                    0.5 * std_in(hv * dv),
                    s + 6,
                );
                f32_tensor(
                    &mut t,
                    &format!("{a}conv1d.weight"),
                    &[conv_dim, taps, 1],
                    -0.5,
                    0.5,
                    s + 7,
                );
                f32_tensor(&mut t, &format!("{a}A_log"), &[hv], -2.0, 0.5, s + 8);
                f32_tensor(&mut t, &format!("{a}dt_bias"), &[hv], -0.5, 0.5, s + 9);
                f32_tensor(&mut t, &format!("{a}norm.weight"), &[dv], 0.8, 1.2, s + 10);
            } else {
                let a = format!("{l}self_attn.");
                quantized(&mut t, &format!("{a}q_proj"), &[h * 2 * hd, d], 4, std_in(d), s + 2);
                quantized(&mut t, &format!("{a}k_proj"), &[kv * hd, d], 4, std_in(d), s + 3);
                quantized(&mut t, &format!("{a}v_proj"), &[kv * hd, d], 4, std_in(d), s + 4);
                quantized(
                    &mut t,
                    &format!("{a}o_proj"),
                    &[d, h * hd],
                    4,
                    0.5 * std_in(h * hd),
                    s + 5,
                );
                f32_tensor(&mut t, &format!("{a}q_norm.weight"), &[hd], 0.8, 1.2, s + 6);
                f32_tensor(&mut t, &format!("{a}k_norm.weight"), &[hd], 0.8, 1.2, s + 7);
            }
            let m = format!("{l}mlp.");
            quantized(&mut t, &format!("{m}gate"), &[e, d], 8, std_in(d), s + 20);
            quantized(
                &mut t,
                &format!("{m}switch_mlp.gate_proj"),
                &[e, inter, d],
                4,
                std_in(d),
                s + 21,
            );
            quantized(
                &mut t,
                &format!("{m}switch_mlp.up_proj"),
                &[e, inter, d],
                4,
                std_in(d),
                s + 22,
            );
            quantized(
                &mut t,
                &format!("{m}switch_mlp.down_proj"),
                &[e, d, inter],
                4,
                0.5 * std_in(inter),
                s + 23,
            );
            quantized(
                &mut t,
                &format!("{m}shared_expert.gate_proj"),
                &[shared, d],
                4,
                std_in(d),
                s + 24,
            );
            quantized(
                &mut t,
                &format!("{m}shared_expert.up_proj"),
                &[shared, d],
                4,
                std_in(d),
                s + 25,
            );
            quantized(
                &mut t,
                &format!("{m}shared_expert.down_proj"),
                &[d, shared],
                4,
                0.5 * std_in(shared),
                s + 26,
            );
            quantized(&mut t, &format!("{m}shared_expert_gate"), &[1, d], 8, std_in(d), s + 27);
        }
        write_safetensors(&dir.join("model.safetensors"), t);
        TinyCheckpoint { dir }
    }

    /// Prompt and decode tokens: a 40-token prefill (past 32 tokens: the chunked DeltaNet, the
    /// simdgroup-matrix GEMM and the expert-sorted MoE with a partial last chunk), then 3 decode
    /// steps (the GEMVs, the step recurrence, the per-token MoE).
    pub fn tokens() -> (Vec<u32>, Vec<u32>) {
        let all: Vec<u32> = (0..43u32).map(|i| (i * 97 + 13) % 250).collect();
        (all[..40].to_vec(), all[40..].to_vec())
    }

    /// The checkpoint's config and its model loaded on backend `b`.
    pub fn model<B: Backend>(&self, b: &B) -> (ModelConfig, Model<B>) {
        let cfg = ModelConfig::from_file(&self.dir.join("config.json")).unwrap();
        let loader = Loader::open(&self.dir, &cfg).unwrap();
        let model = Model::load(b, &loader, &cfg, &mut |_, _| Ok(())).unwrap();
        (cfg, model)
    }

    /// The model on backend `b`: logits of every prompt position (prefill, all logits), then of
    /// each decode step, as the engine computes them.
    pub fn logits<B: Backend>(&self, b: &B) -> Vec<Vec<f32>> {
        let (cfg, model) = self.model(b);
        let (mut state, mut s) = state_and_scratch(b, &cfg, KvDtype::F32);
        let vocab = cfg.vocab_size;
        let (prompt, decode) = Self::tokens();
        let mut outs = Vec::new();
        b.begin(StreamKind::Prefill).unwrap();
        b.write_ids(&mut s.ids, &prompt).unwrap();
        model.forward(b, prompt.len(), 0, &mut state, &mut s);
        for row0 in (0..prompt.len()).step_by(16) {
            let rows = (prompt.len() - row0).min(16);
            model.logits(b, row0, rows, &mut s);
            b.finish().unwrap();
            let mut out = vec![0f32; rows * vocab];
            b.read(&s.logits, 0, &mut out).unwrap();
            outs.extend(out.chunks(vocab).map(<[f32]>::to_vec));
        }
        for (i, &tok) in decode.iter().enumerate() {
            b.begin(StreamKind::Decode).unwrap();
            b.write_ids(&mut s.ids, &[tok]).unwrap();
            model.forward(b, 1, prompt.len() + i, &mut state, &mut s);
            model.logits(b, 0, 1, &mut s);
            b.finish().unwrap();
            let mut out = vec![0f32; vocab];
            b.read(&s.logits, 0, &mut out).unwrap();
            outs.push(out);
        }
        outs
    }
}

/// `got` (a Metal backend's `TinyCheckpoint::logits`) against the reference's `want`: every
/// position within tolx * 1e-4 of max(1, max |logit|); the largest relative error is returned.
pub fn assert_logits_close(got: &[Vec<f32>], want: &[Vec<f32>], tolx: f32, what: &str) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: positions");
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_near(g, w, tolx * 1e-4, &format!("{what} position {i}"));
        let scale = w.iter().fold(1f32, |m, v| m.max(v.abs()));
        worst = worst.max(g.iter().zip(w).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale);
    }
    worst
}

/// One forward pass (40-token prefill, 3 decode steps) of the tiny checkpoint with the kernel
/// variants of each GPU family (set on this backend), against the reference backend.
pub fn forward_per_family_matches_cpu<X: Executor>(dev: &mut Metal<X>, tolx: f32) {
    let ckpt = TinyCheckpoint::write();
    let want = ckpt.logits(&Cpu::reference());
    let saved = dev.variants;
    for f in GpuFamily::ALL {
        dev.variants = Variants::for_family(f);
        let got = ckpt.logits(&*dev);
        let worst = assert_logits_close(&got, &want, tolx, &format!("tiny model, variants of {f}"));
        eprintln!("tiny model, variants of {f}: max |Δlogit| / max(1, max |logit|) = {worst:.2e}");
    }
    dev.variants = saved;
}
