//! Helpers shared by the CPU kernel tests: deterministic data, MLX-style quantized matrices, and a
//! closeness check that names the worst index.
#![allow(dead_code)] // each test crate uses its own subset

use lily_core::{
    backend::{
        cpu::{kv::CpuKv, Cpu},
        params::{AttentionParams, DeltaNetParams, KvStoreParams, RmsNormParams, RopeParams},
        Backend, KvDtype, OneRow,
    },
    ops::attention,
    quant::{Format, Groups, Matrix},
    safetensors::{Bytes, DType},
};

/// A CPU KV cache holding `data` (rows of `width`) in `dtype`, in segments of `seg` rows.
pub fn cpu_cache(data: &[f32], width: usize, dtype: KvDtype, seg: usize) -> CpuKv {
    let rows = data.len() / width;
    let mut kv = CpuKv::new(width, dtype, rows.max(1), seg).unwrap();
    kv.reserve(rows).unwrap();
    let p = KvStoreParams {
        tokens: rows as u32,
        pos0: 0,
        width: width as u32,
    };
    attention::reference::kv_store(&p, data, &mut kv);
    kv
}

/// The params of a DeltaNet call of `t` tokens, Hk / Hv heads of Dk / Dv.
pub fn delta_net_params(t: usize, hk: usize, hv: usize, dk: usize, dv: usize) -> DeltaNetParams {
    DeltaNetParams {
        tokens: t as u32,
        key_heads: hk as u32,
        value_heads: hv as u32,
        key_dim: dk as u32,
        value_dim: dv as u32,
    }
}

/// Random inputs of a DeltaNet recurrence over `t` tokens (hk key heads, hv value heads, dims dk,
/// dv), drawn from `seed`, in the ranges the model's values take: qkv [t, 2 hk dk + hv dv], a and b
/// [t, hv], a_log and dt_bias [hv], the initial state s0 [hv, dk, dv].
#[allow(dead_code)] // not every test binary that includes this module uses it
pub struct DeltaNetInputs {
    pub qkv: Vec<f32>,
    pub a: Vec<f32>,
    pub b: Vec<f32>,
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    pub s0: Vec<f32>,
}

#[allow(dead_code)]
pub fn delta_net_inputs(t: usize, [hk, hv, dk, dv]: [usize; 4], seed: u64) -> DeltaNetInputs {
    DeltaNetInputs {
        qkv: rand_vec(t * (2 * hk * dk + hv * dv), seed, -1.0, 1.0),
        a: rand_vec(t * hv, seed + 1, -3.0, 3.0),
        b: rand_vec(t * hv, seed + 2, -3.0, 3.0),
        a_log: rand_vec(hv, seed + 3, -5.0, 0.7),
        dt_bias: rand_vec(hv, seed + 4, -1.0, 1.0),
        s0: rand_vec(hv * dk * dv, seed + 5, -0.1, 0.1),
    }
}

/// Deterministic pseudo-random values in [lo, hi) (xorshift; no dependency needed).
pub fn rand_vec(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect()
}

/// max |a - b| <= tol * max |b| (relative to the reference's scale), no non-finite output; the
/// message gives the worst index.
pub fn assert_close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
    let (i, err) = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .enumerate()
        .fold((0, 0f32), |m, (i, e)| if e > m.1 || e.is_nan() { (i, e) } else { m });
    assert!(a.iter().all(|x| x.is_finite()), "{what}: non-finite output");
    assert!(
        err <= tol * scale,
        "{what}: max |diff| {err:.3e} at {i} (scale {scale:.3e}, tol {tol:.1e})"
    );
}

/// `v` stored as `dtype` (F32, F16 or BF16), little-endian.
pub fn float_bytes(v: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F16 => v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
        DType::BF16 => v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
        _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// `x` rounded through `dtype`.
fn round_to(x: f32, dtype: DType) -> f32 {
    match dtype {
        DType::F16 => half::f16::from_f32(x).to_f32(),
        DType::BF16 => half::bf16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// A random [experts, rows, cols] matrix in `format`, quantized the MLX affine way with scales and
/// biases stored as `sdtype`; the sign of the scale alternates by group, as MLX's does.
pub fn matrix(experts: usize, rows: usize, cols: usize, format: Format, sdtype: DType, seed: u64) -> Matrix {
    let n = experts * rows * cols;
    let vals = rand_vec(n, seed, -1.0, 1.0);
    let (data, groups) = match format {
        Format::F32 => (float_bytes(&vals, DType::F32), None),
        Format::F16 => (float_bytes(&vals, DType::F16), None),
        Format::BF16 => (float_bytes(&vals, DType::BF16), None),
        Format::Affine { bits, group } => {
            let levels = ((1u32 << bits) - 1) as f32;
            let mut words = vec![0u32; n * bits as usize / 32];
            let (mut scales, mut biases) = (Vec::new(), Vec::new());
            for (g, chunk) in vals.chunks(group).enumerate() {
                let (lo, hi) = chunk
                    .iter()
                    .fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
                let (s, b) = if g % 2 == 0 {
                    ((hi - lo) / levels, lo)
                } else {
                    ((lo - hi) / levels, hi)
                };
                let (s, b) = (round_to(s, sdtype), round_to(b, sdtype));
                scales.push(s);
                biases.push(b);
                for (j, &x) in chunk.iter().enumerate() {
                    let q = ((x - b) / s).round().clamp(0.0, levels) as u32;
                    let bit = (g * group + j) * bits as usize;
                    words[bit / 32] |= q << (bit % 32);
                }
            }
            (
                words.iter().flat_map(|w| w.to_le_bytes()).collect(),
                Some(Groups {
                    dtype: sdtype,
                    scales: Bytes::from_slice(&float_bytes(&scales, sdtype)),
                    biases: Bytes::from_slice(&float_bytes(&biases, sdtype)),
                }),
            )
        }
    };
    let data = Bytes::from_slice(&data);
    Matrix::whole("test".into(), format, [experts, rows, cols], data, groups)
}

/// A random matrix of `stored` rows x `cols` in `format` (scales of `sdtype` for affine), one
/// expert; tests make views of it (`[experts, rows, cols]`, stride and offset).
pub fn stored_matrix(format: Format, sdtype: DType, stored: usize, cols: usize, seed: u64) -> Matrix {
    let (data, groups) = match format {
        Format::F32 => (float_bytes(&rand_vec(stored * cols, seed, -1.0, 1.0), DType::F32), None),
        Format::F16 => (float_bytes(&rand_vec(stored * cols, seed, -1.0, 1.0), DType::F16), None),
        Format::BF16 => (
            float_bytes(&rand_vec(stored * cols, seed, -1.0, 1.0), DType::BF16),
            None,
        ),
        Format::Affine { bits, group } => {
            let words = stored * cols * bits as usize / 32;
            let data: Vec<u8> = rand_vec(words, seed, 0.0, 1.0)
                .iter()
                .enumerate()
                .flat_map(|(i, v)| ((v * 4294967295.0) as u32 ^ (i as u32).wrapping_mul(2654435761)).to_le_bytes())
                .collect();
            let ng = stored * cols / group;
            let s = float_bytes(&rand_vec(ng, seed + 1, -0.1, 0.1), sdtype);
            let b = float_bytes(&rand_vec(ng, seed + 2, -0.5, 0.5), sdtype);
            (
                data,
                Some(Groups {
                    dtype: sdtype,
                    scales: Bytes::from_slice(&s),
                    biases: Bytes::from_slice(&b),
                }),
            )
        }
    };
    Matrix {
        name: "test".into(),
        format,
        experts: 1,
        rows: stored,
        cols,
        expert_stride: 0,
        row_offset: 0,
        data: Bytes::from_slice(&data),
        groups,
    }
}

// ---- the attention family on any backend (reference, CPU, the GPU backends) ----

/// A cache on `b` of `rows` rows of `width` random values in [-1, 1] (seed), stored through the
/// backend's own kv_store (so in its dtype), with room for `max` rows in segments of `seg`.
pub fn filled_cache<B: Backend>(
    b: &B,
    width: usize,
    rows: usize,
    max: usize,
    dtype: KvDtype,
    seg: usize,
    seed: u64,
) -> B::Kv {
    let mut kv = b.kv_new(width, dtype, max, seg).unwrap();
    b.kv_reserve(&mut kv, rows.max(1)).unwrap();
    if rows > 0 {
        let x = b.upload(&rand_vec(rows * width, seed, -1.0, 1.0)).unwrap();
        let p = KvStoreParams {
            tokens: rows as u32,
            pos0: 0,
            width: width as u32,
        };
        b.kv_store(&p, &x, &mut kv);
        b.finish().unwrap();
    }
    kv
}

/// `rms_norm`'s parameters: `rows` rows of `dim`, eps 1e-6.
pub fn norm_params(rows: usize, dim: usize) -> RmsNormParams {
    RmsNormParams {
        rows: rows as u32,
        dim: dim as u32,
        eps: 1e-6,
    }
}

/// `attention`'s parameters for `tokens` tokens on `pos0` cached rows: `heads` query heads on
/// `kv_heads` KV heads of `head_dim`, scale 1 / sqrt(head_dim).
pub fn attention_params(tokens: usize, pos0: usize, heads: usize, kv_heads: usize, head_dim: usize) -> AttentionParams {
    AttentionParams {
        tokens: tokens as u32,
        pos0: pos0 as u32,
        heads: heads as u32,
        kv_heads: kv_heads as u32,
        head_dim: head_dim as u32,
        scale: 1.0 / (head_dim as f32).sqrt(),
    }
}

/// `qk_norm_rope`'s parameters for `tokens` tokens at `pos0` (the heads as in
/// [`attention_params`]), RoPE on the first `rotary_dim` dims with base `theta`, eps 1e-6.
pub fn rope_params(
    tokens: usize,
    pos0: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    theta: f32,
) -> RopeParams {
    RopeParams {
        tokens: tokens as u32,
        pos0: pos0 as u32,
        heads: heads as u32,
        kv_heads: kv_heads as u32,
        head_dim: head_dim as u32,
        rotary_dim: rotary_dim as u32,
        eps: 1e-6,
        theta,
    }
}

/// Prefill of `t` tokens on a cache already holding `pos0` rows, then `decode` single steps
/// (each appending a row first), in caches of `dtype` with segments of `seg` rows. q and the gate
/// uniform in [-q_amp, q_amp] (K and V in [-1, 1]): 1.5 gives scores of std ~0.5 at hd 256, a
/// nearly flat softmax; 12 a peaky one.
#[allow(clippy::too_many_arguments)]
pub fn run_attention<B: Backend>(
    b: &B,
    h: usize,
    kv: usize,
    hd: usize,
    pos0: usize,
    t: usize,
    decode: usize,
    dtype: KvDtype,
    seg: usize,
    q_amp: f32,
) -> Vec<Vec<f32>> {
    let max = pos0 + t + decode;
    let mut kc = filled_cache(b, kv * hd, pos0 + t, max, dtype, seg, 60);
    let mut vc = filled_cache(b, kv * hd, pos0 + t, max, dtype, seg, 61);
    let mut outs = Vec::new();
    let mut pos = pos0;
    for (i, n) in std::iter::once(t).chain(std::iter::repeat_n(1, decode)).enumerate() {
        // The new row's K and V: alive until `finish` (the CUDA backend launches what it recorded
        // there, reading the buffers then).
        let (kr, vr) = (
            b.upload(&rand_vec(kv * hd, 70 + i as u64, -1.0, 1.0)).unwrap(),
            b.upload(&rand_vec(kv * hd, 80 + i as u64, -1.0, 1.0)).unwrap(),
        );
        if i > 0 {
            b.kv_reserve(&mut kc, pos + 1).unwrap();
            b.kv_reserve(&mut vc, pos + 1).unwrap();
            let p = KvStoreParams {
                tokens: 1,
                pos0: pos as u32,
                width: (kv * hd) as u32,
            };
            b.kv_store(&p, &kr, &mut kc);
            b.kv_store(&p, &vr, &mut vc);
        }
        let qg = b
            .upload(&rand_vec(n * h * 2 * hd, 62 + i as u64, -q_amp, q_amp))
            .unwrap();
        let mut out = b.alloc(n * h * hd).unwrap();
        let p = attention_params(n, pos, h, kv, hd);
        b.attention(&p, &qg, &kc, &vc, &mut out);
        b.finish().unwrap();
        let mut o = vec![0f32; n * h * hd];
        b.read(&out, 0, &mut o).unwrap();
        outs.push(o);
        pos += n;
    }
    outs
}

/// A batched mixer op's one-row scratch (`OneRow`) over seven buffers of `len` floats, which the
/// caller keeps: `let mut row = one_row_buffers(len); let mut one = one_row(&mut row);`.
pub fn one_row_buffers(len: usize) -> [Vec<f32>; 7] {
    [(); 7].map(|_| vec![0f32; len])
}

/// See [`one_row_buffers`].
pub fn one_row(row: &mut [Vec<f32>; 7]) -> OneRow<'_, Cpu> {
    let [proj, a, b, k, v, mixed, core] = row;
    OneRow {
        proj,
        a,
        b,
        k,
        v,
        mixed,
        core,
    }
}
