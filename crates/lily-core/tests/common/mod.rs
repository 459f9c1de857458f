//! Helpers shared by the CPU kernel tests: deterministic data, MLX-style quantized matrices, and a
//! closeness check that names the worst index.
#![allow(dead_code)] // each test crate uses its own subset

use lily_core::{
    backend::{cpu::kv::CpuKv, params::KvStoreParams, KvDtype},
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
    Matrix {
        name: "test".into(),
        format,
        experts,
        rows,
        cols,
        expert_stride: rows,
        row_offset: 0,
        data: Bytes::from_slice(&data),
        groups,
    }
}
