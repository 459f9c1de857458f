//! GEMV / GEMM throughput of the CPU kernels at the real Qwen3.6-35B-A3B shapes (architecture.md
//! §13), 4-bit group-64 with bf16 scales as in the MLX checkpoints, next to this machine's
//! measured read bandwidth and f32 FMA peak. A plain binary (`harness = false`) so it needs no
//! extra dependency: `cargo bench -p lily-core --bench gemv [-- --isa avx2|portable] [--quick] [--only TEXT]
//! [--precision exact|fast]` (`--only`: just the cases whose name contains TEXT; `--precision`: how
//! the 4-bit matmuls round x, the engine's option of that name, default exact).
//! Each figure is the median of several runs (the machine may be shared).

mod common;

use common::{copy_bandwidth, peak_gflops, rand_bytes, read_bandwidth, time};
use lily_core::{
    backend::cpu::{isa::Isa, pool, Precision},
    ops::matmul,
    quant::{Format, Groups, Matrix},
    safetensors::{Bytes, DType},
};

/// A random [experts, rows, cols] matrix: 4/8-bit affine group 64 (bf16 scales) or bf16.
fn matrix(experts: usize, rows: usize, cols: usize, format: Format) -> Matrix {
    let n = experts * rows * cols;
    let (data, groups) = match format {
        Format::Affine { bits, group } => {
            let g = n / group;
            // Scales ~1e-2 and biases ~-8e-2 (bf16 bytes 0x3c23 / 0xbda3) keep outputs finite.
            let s: Vec<u8> = (0..g).flat_map(|_| [0x23u8, 0x3c]).collect();
            let b: Vec<u8> = (0..g).flat_map(|_| [0xa3u8, 0xbd]).collect();
            let groups = Groups {
                dtype: DType::BF16,
                scales: Bytes::from_slice(&s),
                biases: Bytes::from_slice(&b),
            };
            (rand_bytes(n * bits as usize / 8, 7), Some(groups))
        }
        // bf16 values with a small exponent: the top byte 0x3c.
        _ => ((0..n).flat_map(|i| [(i * 37) as u8, 0x3c]).collect(), None),
    };
    let data = Bytes::from_slice(&data);
    Matrix::whole("bench".into(), format, [experts, rows, cols], data, groups)
}

fn main() {
    // One pool session, as the engine runs its kernels (`Backend::run`): the workers wait for
    // each parallel loop spinning instead of asleep.
    pool::run(bench);
}

fn bench() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let run = |name: &str| only.as_deref().is_none_or(|o| name.contains(o));
    let isa = match args
        .iter()
        .position(|a| a == "--isa")
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
    {
        Some("portable") => Isa::Portable,
        Some("avx2") => Isa::Avx2,
        _ => Isa::get(),
    };
    assert!(isa.available(), "{isa:?} is not available on this CPU");
    let prec = args
        .iter()
        .position(|a| a == "--precision")
        .and_then(|i| args.get(i + 1))
        .map(|p| Precision::parse(p).expect("--precision"))
        .unwrap_or_default();
    let reps = if quick { 5 } else { 11 };
    println!(
        "isa {isa:?}, precision {}, {} pool threads",
        prec.name(),
        pool::threads()
    );
    let bw = read_bandwidth(reps);
    let cbw = copy_bandwidth(reps);
    let peak = peak_gflops(isa, reps);
    println!("memory: read {bw:.1} GB/s, copy (read+write) {cbw:.1} GB/s; f32 FMA peak {peak:.0} GFLOP/s");

    let q4 = Format::Affine { bits: 4, group: 64 };
    let q8 = Format::Affine { bits: 8, group: 64 };
    let cases: Vec<(&str, usize, usize, usize, Format)> = vec![
        ("in_proj_qkv 2048->8192 q4", 1, 8192, 2048, q4),
        ("out_proj 4096->2048 q4", 1, 2048, 4096, q4),
        ("router 2048->256 q8", 1, 256, 2048, q8),
        ("in_proj_qkv 2048->8192 q8", 1, 8192, 2048, q8),
        ("in_proj_qkv 2048->8192 bf16", 1, 8192, 2048, Format::BF16),
        ("lm_head 2048->248320 q4", 1, 248320, 2048, q4),
    ];
    println!("\nGEMV (decode, 1 token)                      GB/s   of read BW");
    for (name, e, n, k, f) in &cases {
        if quick && *n > 100_000 || !run(name) {
            continue;
        }
        // Enough copies (as experts) to span 1 GiB, used in turn: this machine's L3 is large
        // enough to hold a small matrix, and decode never finds its weights in cache.
        let one = matrix(1, *n, *k, *f).bytes_per_row() * n;
        let copies = (*e).max((1usize << 30) / one).max(1);
        let m = matrix(copies, *n, *k, *f);
        let x: Vec<f32> = (0..*k).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
        let mut out = vec![0f32; *n];
        let mut c = 0;
        let s = time(reps, || {
            c = (c + 1) % copies;
            matmul::cpu::gemv(isa, prec, &m, c, &x, &mut out)
        });
        let gbs = (m.bytes_per_row() * n) as f64 / s / 1e9;
        println!("{name:<42} {gbs:6.1}   {:4.0}%", 100.0 * gbs / bw);
    }

    // Compute ceiling: one expert-sized matrix that stays in L2, so the kernel, not memory, limits.
    for (name, f) in [
        ("in-cache 2048->512 q4 (compute bound)", q4),
        ("in-cache 2048->512 q8 (compute bound)", q8),
    ] {
        if !run(name) {
            continue;
        }
        let m = matrix(1, 512, 2048, f);
        let x: Vec<f32> = (0..2048).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
        let mut out = vec![0f32; 512];
        let s = time(reps * 20, || matmul::cpu::gemv(isa, prec, &m, 0, &x, &mut out));
        let gbs = (m.bytes_per_row() * 512) as f64 / s / 1e9;
        println!("{name:<42} {gbs:6.1}   {:4.0}%", 100.0 * gbs / bw);
    }

    // The batched row kernel's compute ceiling: the in-cache matrix above against B tokens (a
    // batched decode step's shared weights). GB/s counts the weight bytes once per call, so a kernel
    // that keeps B tokens at the one-token byte rate shows the same GB/s at every B (B x the tok/s).
    for b in [1usize, 2, 4, 8] {
        let name = format!("in-cache batch {b} 2048->512 q4");
        if !run(&name) {
            continue;
        }
        let m = matrix(1, 512, 2048, q4);
        let x: Vec<f32> = (0..b * 2048).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
        let mut out = vec![0f32; b * 512];
        let s = time(reps * 20, || {
            if b == 1 {
                matmul::cpu::gemv(isa, prec, &m, 0, &x, &mut out)
            } else {
                matmul::cpu::gemv_batch(isa, prec, &m, 0, &x, b, &mut out)
            }
        });
        let gbs = (m.bytes_per_row() * 512) as f64 / s / 1e9;
        println!(
            "{name:<42} {gbs:6.1}   {:4.0}%  {:8.0} tok/s",
            100.0 * gbs / bw,
            b as f64 / s
        );
    }

    // MoE decode: 8 of 256 experts, gate + up [512, 2048] and down [2048, 512], as the kernel runs.
    if run("MoE 8 experts 2048->512x2->2048 q4") {
        use lily_core::{backend::params::MoeParams, ops::moe};
        let (e_n, inter, d) = (256, 512, 2048);
        let (g, u, dn) = (
            matrix(e_n, inter, d, q4),
            matrix(e_n, inter, d, q4),
            matrix(e_n, d, inter, q4),
        );
        let x: Vec<f32> = (0..d).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
        let w = vec![0.125f32; 8];
        let mut tmp = vec![0f32; 8 * (inter + d)];
        let mut out = vec![0f32; d];
        let mut step = 0u32;
        let s = time(reps, || {
            // Different experts every call, as in decode (no cache reuse between calls).
            step += 1;
            let ids: Vec<u32> = (0..8).map(|i| (step * 37 + i * 31) % 256).collect();
            let p = MoeParams { tokens: 1, top_k: 8 };
            moe::cpu::moe_experts_with(isa, prec, &p, &x, &ids, &w, &g, &u, &dn, &mut tmp, &mut out);
        });
        let bytes = 8 * (2 * inter * g.bytes_per_row() + d * dn.bytes_per_row());
        let gbs = bytes as f64 / s / 1e9;
        println!(
            "{:<42} {gbs:6.1}   {:4.0}%",
            "MoE 8 experts 2048->512x2->2048 q4",
            100.0 * gbs / bw
        );
    }

    // A batched decode step's matmuls (one token per sequence, B sequences): a dense projection
    // and the routed experts (8 of 256 per token, different experts per token and call), from
    // DRAM. Aggregate tokens per second of the kernel alone: with the weights shared, it should
    // grow with B while the step stays memory-bound.
    for b in [1usize, 4, 8] {
        let name = format!("batch {b} in_proj_qkv 2048->8192 q4");
        if run(&name) {
            let (n, k) = (8192, 2048);
            let one = matrix(1, n, k, q4).bytes_per_row() * n;
            let copies = ((1usize << 30) / one).max(1);
            let m = matrix(copies, n, k, q4);
            let x: Vec<f32> = (0..b * k).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
            let mut out = vec![0f32; b * n];
            let mut c = 0;
            let s = time(reps, || {
                c = (c + 1) % copies;
                if b == 1 {
                    matmul::cpu::gemv(isa, prec, &m, c, &x, &mut out)
                } else {
                    matmul::cpu::gemv_batch(isa, prec, &m, c, &x, b, &mut out)
                }
            });
            println!(
                "{name:<42} {:8.0} tok/s  {:6.1} GB/s",
                b as f64 / s,
                one as f64 / s / 1e9
            );
            if b > 1 {
                // The prefill's dequantized f32 tile GEMM on the same step, for comparison.
                let s = time(reps, || {
                    c = (c + 1) % copies;
                    matmul::cpu::gemm(isa, &m, c, &x, b, &mut out)
                });
                let name = format!("batch {b} in_proj_qkv as f32-tile gemm");
                println!("{name:<42} {:8.0} tok/s", b as f64 / s);
            }
        }
        let name = format!("batch {b} MoE 8 experts 2048->512x2->2048 q4");
        if run(&name) {
            use lily_core::{backend::params::MoeParams, ops::moe};
            let (e_n, inter, d) = (256, 512, 2048);
            let (g, u, dn) = (
                matrix(e_n, inter, d, q4),
                matrix(e_n, inter, d, q4),
                matrix(e_n, d, inter, q4),
            );
            let x: Vec<f32> = (0..b * d).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
            let w = vec![0.125f32; b * 8];
            let mut tmp = vec![0f32; b * 8 * (inter + d)];
            let mut out = vec![0f32; b * d];
            let (mut step, mut ids) = (0u32, vec![0u32; b * 8]);
            let s = time(reps, || {
                step += 1;
                for (i, id) in ids.iter_mut().enumerate() {
                    *id = (step * 37 + (i as u32 % 8) * 31 + (i as u32 / 8) * 11) % 256;
                }
                let p = MoeParams {
                    tokens: b as u32,
                    top_k: 8,
                };
                moe::cpu::moe_experts_with(isa, prec, &p, &x, &ids, &w, &g, &u, &dn, &mut tmp, &mut out);
            });
            println!("{name:<42} {:8.0} tok/s", b as f64 / s);
        }
    }

    // Decode attention over a 4K bf16 KV cache (16 query / 2 KV heads of 256, the real shape):
    // GB/s of K and V read. Eight caches in rotation (67 MB) so each call reads from DRAM.
    let name = "decode attention 16q/2kv x 256, 4K bf16 context";
    if run(name) {
        use lily_core::{
            backend::{
                cpu::kv::CpuKv,
                params::{AttentionParams, KvStoreParams},
                KvDtype,
            },
            ops::attention,
        };
        let (h, kv, hd, len) = (16usize, 2usize, 256usize, 4096usize);
        let cache = |c: usize, m: usize| {
            let data: Vec<f32> = (0..len * kv * hd)
                .map(|i| ((i * m + c) % 97) as f32 / 97.0 - 0.5)
                .collect();
            let mut kc = CpuKv::new(kv * hd, KvDtype::BF16, len, 1024).expect("cache");
            kc.reserve(len).expect("cache rows");
            let p = KvStoreParams {
                tokens: len as u32,
                pos0: 0,
                width: (kv * hd) as u32,
            };
            attention::reference::kv_store(&p, &data, &mut kc);
            kc
        };
        let caches: Vec<(CpuKv, CpuKv)> = (0..8).map(|c| (cache(c, 53), cache(c, 29))).collect();
        let qg: Vec<f32> = (0..h * 2 * hd).map(|i| (i % 101) as f32 / 101.0 - 0.5).collect();
        let p = AttentionParams {
            tokens: 1,
            pos0: (len - 1) as u32,
            heads: h as u32,
            kv_heads: kv as u32,
            head_dim: hd as u32,
            scale: 1.0 / 16.0,
        };
        let mut out = vec![0f32; h * hd];
        let mut c = 0;
        let s = time(reps * 4, || {
            c = (c + 1) % caches.len();
            attention::cpu::attention_with(isa, &p, &qg, &caches[c].0, &caches[c].1, &mut out);
        });
        let gbs = (2 * len * kv * hd * 2) as f64 / s / 1e9;
        println!("{name:<42} {gbs:6.1}   {:4.0}%", 100.0 * gbs / bw);
    }

    println!("\nGEMM (prefill)                      tokens  GFLOP/s  of peak");
    for (name, n, k, t) in [
        ("in_proj_qkv 2048->8192 q4", 8192, 2048, 256),
        ("out_proj 4096->2048 q4", 2048, 4096, 256),
    ] {
        if !run(&format!("prefill {name}")) {
            continue;
        }
        let m = matrix(1, n, k, q4);
        let x: Vec<f32> = (0..t * k).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
        let mut out = vec![0f32; t * n];
        let p = lily_core::backend::params::MatmulParams {
            tokens: t as u32,
            x_row0: 0,
        };
        let s = time(reps.min(5), || {
            matmul::cpu::matmul_with(isa, prec, &p, &m, &x, &mut out)
        });
        let gf = (2 * n * k * t) as f64 / s / 1e9;
        println!("{name:<36} {t:6}  {gf:7.1}  {:5.0}%", 100.0 * gf / peak);
    }

    // MoE prefill: 256 tokens (~8 per expert), 512 and 1024 (the CPU's prefill chunk, ~32 per expert),
    // each to 8 of 256 experts, gate + up [512, 2048] and down [2048, 512] per expert.
    let name = "MoE top-8 of 256, 2048->512x2->2048 q4";
    for t in if quick { vec![256] } else { vec![256, 512, 1024] } {
        if !run(&format!("prefill {name}")) {
            continue;
        }
        use lily_core::{backend::params::MoeParams, ops::moe};
        let (e_n, inter, d) = (256, 512, 2048);
        let (g, u, dn) = (
            matrix(e_n, inter, d, q4),
            matrix(e_n, inter, d, q4),
            matrix(e_n, d, inter, q4),
        );
        let x: Vec<f32> = (0..t * d).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
        let ids: Vec<u32> = (0..t * 8).map(|i| ((i / 8) * 37 + (i % 8) * 31) as u32 % 256).collect();
        let w = vec![0.125f32; t * 8];
        let mut tmp = vec![0f32; t * 8 * (inter + d)];
        let mut out = vec![0f32; t * d];
        let p = MoeParams {
            tokens: t as u32,
            top_k: 8,
        };
        let s = time(reps.min(5), || {
            moe::cpu::moe_experts_with(isa, prec, &p, &x, &ids, &w, &g, &u, &dn, &mut tmp, &mut out)
        });
        let gf = (t * 8 * 3 * 2 * inter * d) as f64 / s / 1e9;
        println!("{name:<36} {t:6}  {gf:7.1}  {:5.0}%", 100.0 * gf / peak);
    }
}
