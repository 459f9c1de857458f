//! Matrix descriptors: any dtypes, shapes and quantization block (each tensor's bytes sized as the
//! safetensors parser guarantees) go through `weights::matrix`; what it accepts must be readable in
//! full: every row of every expert dequantizes within its bytes, without a panic.
#![no_main]
use libfuzzer_sys::{arbitrary, arbitrary::Arbitrary, fuzz_target};
use lily_core::{
    config::{QuantSpec, Quantization},
    safetensors::{Bytes, DType, TensorView},
    weights::matrix,
};

#[derive(Arbitrary, Debug)]
struct Input {
    w_dtype: u8,
    w_shape: Vec<u8>,
    groups: Option<(u8, Vec<u8>, u8, Vec<u8>)>, // (scales dtype, shape, biases dtype, shape)
    quant: Option<(u8, u8)>,                     // (bits, group size) selectors
    lead: Vec<u8>,
    rows: u8,
    cols: u16,
}

const DTYPES: [(&str, DType, usize); 5] = [
    ("F32", DType::F32, 4),
    ("F16", DType::F16, 2),
    ("BF16", DType::BF16, 2),
    ("U32", DType::U32, 4),
    ("I64", DType::Other, 8),
];

fn tensor(name: &str, dtype: u8, shape: &[u8]) -> Option<TensorView> {
    let (dtype_name, dtype, size) = DTYPES[dtype as usize % DTYPES.len()];
    let shape: Vec<usize> = shape.iter().take(4).map(|&d| d as usize % 40).collect();
    let bytes = shape.iter().product::<usize>() * size;
    if bytes > 1 << 20 {
        return None;
    }
    let data: Vec<u8> = (0..bytes).map(|i| (i * 131 % 251) as u8).collect();
    Some(TensorView {
        name: name.into(),
        dtype,
        dtype_name: dtype_name.into(),
        shape,
        bytes: Bytes::from_slice(&data),
    })
}

fuzz_target!(|inp: Input| {
    let Some(w) = tensor("m.weight", inp.w_dtype, &inp.w_shape) else {
        return;
    };
    let groups = match &inp.groups {
        Some((sd, ss, bd, bs)) => match (tensor("m.scales", *sd, ss), tensor("m.biases", *bd, bs)) {
            (Some(s), Some(b)) => Some((s, b)),
            _ => return,
        },
        None => None,
    };
    let quant = inp.quant.map(|(b, g)| Quantization {
        default: QuantSpec {
            bits: [2, 4, 8][b as usize % 3],
            group_size: [32, 64, 128][g as usize % 3],
        },
        overrides: Vec::new(),
    });
    let lead: Vec<usize> = inp.lead.iter().take(2).map(|&d| d as usize % 9).collect();
    let (rows, cols) = (inp.rows as usize % 40, inp.cols as usize % 300);
    let g = groups.as_ref().map(|(s, b)| (s, b));
    if let Ok(m) = matrix("m", &w, g, quant.as_ref(), &lead, rows, cols) {
        let mut out = vec![0f32; m.cols];
        for e in 0..m.experts {
            for r in 0..m.rows {
                m.dequant_row(e, r, &mut out);
            }
        }
    }
});
