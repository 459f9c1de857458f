//! The elementwise ops on Metal (`shaders/metal/elementwise.metal`): one thread per element,
//! [`rows_grid`] (dim, T).

use crate::backend::{
    metal::{args::bytes_of, rows_grid, Arg, Executor, Fixed, Metal, MetalBuf},
    params::RowsParams,
};

pub fn add<X: Executor>(m: &Metal<X>, p: &RowsParams, x: &mut MetalBuf<X>, y: &MetalBuf<X>) {
    let n = (p.tokens * p.dim) as usize;
    if !m.fits("add", &[("x", x.len(), n), ("y", y.len(), n)]) {
        return;
    }
    let args = [Arg::Bytes(bytes_of(p)), x.arg(), y.arg()];
    m.encode(Fixed::Add, &args, rows_grid(p.dim as usize, p.tokens as usize));
}

pub fn swiglu<X: Executor>(m: &Metal<X>, p: &RowsParams, gate: &MetalBuf<X>, up: &MetalBuf<X>, out: &mut MetalBuf<X>) {
    let n = (p.tokens * p.dim) as usize;
    let checks = [("gate", gate.len(), n), ("up", up.len(), n), ("out", out.len(), n)];
    if !m.fits("swiglu", &checks) {
        return;
    }
    let args = [Arg::Bytes(bytes_of(p)), gate.arg(), up.arg(), out.arg()];
    m.encode(Fixed::Swiglu, &args, rows_grid(p.dim as usize, p.tokens as usize));
}

pub fn sigmoid_gate_add<X: Executor>(
    m: &Metal<X>,
    p: &RowsParams,
    y: &MetalBuf<X>,
    gate: &MetalBuf<X>,
    out: &mut MetalBuf<X>,
) {
    let n = (p.tokens * p.dim) as usize;
    let checks = [
        ("y", y.len(), n),
        ("gate", gate.len(), p.tokens as usize),
        ("out", out.len(), n),
    ];
    if !m.fits("sigmoid_gate_add", &checks) {
        return;
    }
    let args = [Arg::Bytes(bytes_of(p)), y.arg(), gate.arg(), out.arg()];
    m.encode(
        Fixed::SigmoidGateAdd,
        &args,
        rows_grid(p.dim as usize, p.tokens as usize),
    );
}

/// dst[dst_off..dst_off + len] = src[src_off..src_off + len], encoded in the stream (bounds checked by
/// the caller): one row of `len` threads over the two bound regions.
pub fn copy_rows<X: Executor>(
    m: &Metal<X>,
    src: &MetalBuf<X>,
    src_off: usize,
    dst: &mut MetalBuf<X>,
    dst_off: usize,
    len: usize,
) {
    let p = RowsParams {
        tokens: 1,
        dim: len as u32,
    };
    let args = [Arg::Bytes(bytes_of(&p)), src.part(src_off, len), dst.part(dst_off, len)];
    m.encode(Fixed::CopyRows, &args, rows_grid(len, 1));
}
