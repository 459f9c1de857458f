use lily_core::backend::{
    cpu::{kernels, pool, simd::Isa},
    params::AttentionParams,
};
use std::time::Instant;
fn main() {
    for &(h, kv, len) in &[(16usize, 2usize, 4097usize), (8, 1, 8193)] {
        let hd = 256;
        let qg: Vec<f32> = (0..h * 2 * hd).map(|i| ((i * 37 % 101) as f32 / 101.0) - 0.5).collect();
        let kc: Vec<f32> = (0..len * kv * hd)
            .map(|i| ((i * 53 % 97) as f32 / 97.0) - 0.5)
            .collect();
        let vc: Vec<f32> = (0..len * kv * hd)
            .map(|i| ((i * 29 % 89) as f32 / 89.0) - 0.5)
            .collect();
        let junk: Vec<f32> = vec![1.0; 64 << 20];
        let p = AttentionParams {
            tokens: 1,
            pos0: (len - 1) as u32,
            heads: h as u32,
            kv_heads: kv as u32,
            head_dim: hd as u32,
            scale: 0.0625,
        };
        let mut out = vec![0f32; h * hd];
        let isa = Isa::get();
        pool::run(|| {
            let mut best = f64::MAX;
            let mut tot = 0.0;
            let mut s = 0.0;
            for _ in 0..30 {
                s += junk.iter().step_by(16).sum::<f32>();
                let t = Instant::now();
                kernels::attention_with(isa, &p, &qg, &kc, &vc, &mut out);
                let e = t.elapsed().as_secs_f64() * 1e6;
                best = best.min(e);
                tot += e;
            }
            println!(
                "h {h} kv {kv} len {len}: best {best:.0} us, mean {:.0} us ({s})",
                tot / 30.0
            );
        });
    }
}
