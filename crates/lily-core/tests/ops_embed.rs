//! The embed family: the CPU kernel and the Metal kernels (simulator; the device on macOS)
//! against the reference twin.

mod common;
#[macro_use]
mod metal_common;

use common::matrix;
use lily_core::{
    backend::{
        cpu::Cpu,
        metal::{Executor, Metal},
        Backend,
    },
    quant::Format,
    safetensors::DType,
};
use metal_common::{ids_buf, read_all, stored_matrix, TOL};

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

metal_tests!(embed_matches_reference);

fn embed_matches_reference<X: Executor>(dev: &mut Metal<X>, tolx: f32) {
    for (format, sd, d) in [
        (Format::BF16, DType::F32, 72),
        (Format::Affine { bits: 4, group: 64 }, DType::BF16, 128),
    ] {
        let m = stored_matrix(format, sd, 50, d, 30);
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
