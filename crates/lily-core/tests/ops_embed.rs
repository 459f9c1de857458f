//! The embed family: the CPU kernel and the GPU kernels (Metal and CUDA, simulators and
//! devices: `gpu_tests!`) against the reference twin.

mod common;
#[macro_use]
mod gpu_common;

use common::{matrix, stored_matrix};
use gpu_common::{ids_buf, read_all, TOL};
use lily_core::{
    backend::{cpu::Cpu, Backend},
    quant::Format,
    safetensors::DType,
};

mod cpu {
    use super::*;

    #[test]
    fn embed_matches_reference() {
        let (fast, refr) = (Cpu::new(), Cpu::reference());
        let table = matrix(1, 50, 128, Format::Affine { bits: 4, group: 64 }, DType::BF16, 7);
        let ids = vec![0u32, 49, 7, 7, 23];
        let (mut a, mut b) = (vec![0f32; 5 * 128], vec![0f32; 5 * 128]);
        fast.embed(5, &table, &ids, &mut a);
        refr.embed(5, &table, &ids, &mut b);
        assert_eq!(a, b);
    }
}

gpu_tests!(embed_matches_reference);

/// Rows of a bf16, an f16 and a 4-bit table (ids repeated, the first and the last row).
fn embed_matches_reference<B: Backend>(dev: &mut B, tolx: f32) {
    for (format, sd, d) in [
        (Format::BF16, DType::F32, 72),
        (Format::F16, DType::F32, 300),
        (Format::Affine { bits: 4, group: 64 }, DType::BF16, 128),
    ] {
        for m in [stored_matrix(format, sd, 50, d, 30), matrix(1, 50, d, format, sd, 30)] {
            let ids = [7u32, 0, 49, 7, 13];
            both!(dev, tolx * TOL, format!("embed {format:?}"), b => {
                let table = b.upload_matrix(&m).unwrap();
                let ib = ids_buf(b, &ids);
                let mut out = b.alloc(ids.len() * d).unwrap();
                b.embed(ids.len(), &table, &ib, &mut out);
                b.finish().unwrap();
                vec![read_all(b, &out, ids.len() * d)]
            });
        }
    }
}
