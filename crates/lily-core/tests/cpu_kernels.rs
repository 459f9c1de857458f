//! Every production CPU kernel against its plain-loop reference twin, through the `Backend`
//! interface, on shapes with partial blocks and every weight format.

mod common;

use common::{assert_close, matrix, rand_vec};
use lily_core::{
    backend::{cpu::Cpu, params::*, Backend},
    quant::Format,
    safetensors::DType,
};

fn both() -> (Cpu, Cpu) {
    (Cpu::new(), Cpu::reference())
}

#[test]
fn moe_matches_reference() {
    let (fast, refr) = both();
    let (e, k, d, i) = (16usize, 8usize, 128usize, 64usize);
    for &t in &[1usize, 6] {
        let logits = rand_vec(t * e, 1 + t as u64, -3.0, 3.0);
        let rp = RouteParams {
            tokens: t as u32,
            experts: e as u32,
            top_k: k as u32,
            renorm: 1,
        };
        let (mut ia, mut ib) = (vec![0u32; t * k], vec![0u32; t * k]);
        let (mut wa, mut wb) = (vec![0f32; t * k], vec![0f32; t * k]);
        fast.moe_route(&rp, &logits, &mut ia, &mut wa);
        refr.moe_route(&rp, &logits, &mut ib, &mut wb);
        assert_eq!(ia, ib, "moe_route ids");
        assert_close(&wa, &wb, 1e-6, "moe_route weights");
        for wt in wa.chunks(k) {
            assert!(
                (wt.iter().sum::<f32>() - 1.0).abs() < 1e-5,
                "renormalised weights sum to 1"
            );
        }
        for format in [Format::BF16, Format::Affine { bits: 4, group: 64 }] {
            let gate = matrix(e, i, d, format, DType::BF16, 21);
            let up = matrix(e, i, d, format, DType::BF16, 22);
            let down = matrix(e, d, i, format, DType::BF16, 23);
            let x = rand_vec(t * d, 24, -1.0, 1.0);
            let mp = MoeParams {
                tokens: t as u32,
                top_k: k as u32,
            };
            let mut tmp = vec![0f32; t * k * (i + d)];
            let (mut a, mut b) = (vec![0f32; t * d], vec![0f32; t * d]);
            fast.moe_experts(&mp, &x, &ia, &wa, &gate, &up, &down, &mut tmp, &mut a);
            refr.moe_experts(&mp, &x, &ia, &wa, &gate, &up, &down, &mut tmp, &mut b);
            assert_close(&a, &b, 1e-5, &format!("moe_experts {format:?} t={t}"));
        }
    }
}
