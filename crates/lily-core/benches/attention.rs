//! Decode attention on the CPU at long context, Qwen3.6's shapes (16 query heads, 2 KV heads,
//! head_dim 256: architecture.md section 5), against this machine's read bandwidth and f32 FMA
//! peak measured in the same run. One decode step of one attention layer reads every K and V
//! row once: 2 x context x 512 values in the cache's dtype, and does 2 x 16 x 256 multiply-adds
//! per key (scores and P.V). `--tokens T` times a prefill chunk of T tokens ending at the context
//! instead (token t sees pos0 + t + 1 keys; KV GB/s then counts each row once). A plain binary:
//! `cargo bench -p lily-core --bench attention [-- --context 4096,32768,131072] [--dtype bf16,f32] [--tokens 1] [--isa avx512bf16|avx512|avx2|portable]`.

mod common;

use common::{peak_gflops, read_bandwidth, time};
use lily_core::{
    backend::{
        cpu::{isa::Isa, kv::CpuKv, pool},
        params::{AttentionParams, KV_SEGMENT_ROWS},
        KvDtype,
    },
    ops::attention,
};

const HEADS: usize = 16;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 256;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    let i = args.iter().position(|a| a == name)?;
    args.get(i + 1).cloned()
}

/// A cache of `rows` rows with values in [-1, 1) (a cheap deterministic hash).
fn cache(dtype: KvDtype, rows: usize, seed: u32) -> CpuKv {
    let width = KV_HEADS * HEAD_DIM;
    let mut kv = CpuKv::new(width, dtype, rows, KV_SEGMENT_ROWS).expect("cache");
    kv.reserve(rows).expect("rows");
    let mut x = vec![0f32; width];
    for r in 0..rows {
        for (j, v) in x.iter_mut().enumerate() {
            let h = (r as u32).wrapping_mul(0x9E37_79B9) ^ (j as u32).wrapping_mul(0x85EB_CA6B) ^ seed;
            *v = (h.wrapping_mul(0xC2B2_AE35) >> 8) as f32 / (1 << 23) as f32 - 1.0;
        }
        kv.store_row(r, 0, &x);
    }
    kv
}

fn main() {
    pool::run(bench);
}

fn bench() {
    // `--isa avx512` runs AVX-512 without avx512_bf16 (the widening kernels), `avx512bf16` with.
    let chosen = match arg("--isa").as_deref() {
        Some("portable") => Some((Isa::Portable, false)),
        Some("avx2") => Some((Isa::Avx2, false)),
        Some("avx512") => Some((Isa::Avx512, false)),
        Some("avx512bf16") => Some((Isa::Avx512, true)),
        _ => None,
    };
    let kern = chosen.map_or_else(
        || attention::cpu::Kernels::of(Isa::get()),
        |(isa, bf16_dot)| attention::cpu::Kernels { isa, bf16_dot },
    );
    let isa = kern.isa;
    assert!(isa.available(), "{isa:?} is not available on this CPU");
    assert!(
        !kern.bf16_dot || isa.bf16_dot_available(),
        "avx512_bf16 is not available on this CPU"
    );
    let contexts: Vec<usize> = arg("--context")
        .unwrap_or("4096,32768,131072".into())
        .split(',')
        .map(|c| c.trim().parse().expect("--context: comma-separated integers"))
        .collect();
    let dtypes: Vec<KvDtype> = arg("--dtype")
        .unwrap_or("bf16,f32".into())
        .split(',')
        .map(|d| KvDtype::parse(d.trim()).expect("--dtype"))
        .collect();
    let tokens: usize = arg("--tokens").map_or(1, |t| t.parse().expect("--tokens: an integer"));
    let bw = read_bandwidth(5);
    let peak = peak_gflops(isa, 5);
    println!(
        "isa {isa:?} (avx512_bf16 dot: {}), {} threads: read {bw:.1} GB/s, f32 FMA peak {peak:.0} GFLOP/s",
        kern.bf16_dot,
        pool::threads()
    );
    println!("{tokens} token(s) per step");
    println!("| dtype | context | ms/step | KV GB/s | % of read BW | GFLOP/s | % of FMA peak |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let qg: Vec<f32> = (0..tokens * HEADS * 2 * HEAD_DIM)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let mut out = vec![0f32; tokens * HEADS * HEAD_DIM];
    for &dtype in &dtypes {
        for &ctx in contexts.iter().filter(|&&c| c >= tokens) {
            let (k, v) = (cache(dtype, ctx, 1), cache(dtype, ctx, 2));
            let p = AttentionParams {
                tokens: tokens as u32,
                pos0: (ctx - tokens) as u32,
                heads: HEADS as u32,
                kv_heads: KV_HEADS as u32,
                head_dim: HEAD_DIM as u32,
                scale: 1.0 / (HEAD_DIM as f32).sqrt(),
            };
            let s = time(9, || attention::cpu::attention_kernels(kern, &p, &qg, &k, &v, &mut out));
            let bytes = 2.0 * ctx as f64 * (KV_HEADS * HEAD_DIM) as f64 * dtype.size() as f64;
            let keys: usize = (ctx - tokens + 1..=ctx).sum();
            let flops = 2.0 * 2.0 * (keys * HEADS * HEAD_DIM) as f64;
            let (gbs, gfl) = (bytes / s / 1e9, flops / s / 1e9);
            println!(
                "| {} | {ctx} | {:.3} | {gbs:.1} | {:.0} % | {gfl:.0} | {:.0} % |",
                dtype.name(),
                s * 1e3,
                100.0 * gbs / bw,
                100.0 * gfl / peak
            );
        }
    }
}
