//! The norms on Metal (`shaders/metal/norm.metal`): one threadgroup per row of
//! [`norm_threads`] threads.

use crate::backend::{
    metal::{args::bytes_of, norm_threads, Arg, Executor, Fixed, Grid, Metal, MetalBuf},
    params::RmsNormParams,
};

pub fn rms_norm<X: Executor>(m: &Metal<X>, p: &RmsNormParams, x: &MetalBuf<X>, w: &MetalBuf<X>, out: &mut MetalBuf<X>) {
    let n = (p.rows * p.dim) as usize;
    let checks = [("x", x.len(), n), ("w", w.len(), p.dim as usize), ("out", out.len(), n)];
    if m.fits("rms_norm", &checks) {
        let args = [Arg::Bytes(bytes_of(p)), x.arg(), w.arg(), out.arg()];
        m.encode(Fixed::RmsNorm, &args, rows(p));
    }
}

pub fn rms_norm_gated<X: Executor>(
    m: &Metal<X>,
    p: &RmsNormParams,
    x: &MetalBuf<X>,
    z: &MetalBuf<X>,
    w: &MetalBuf<X>,
    out: &mut MetalBuf<X>,
) {
    let n = (p.rows * p.dim) as usize;
    let checks = [
        ("x", x.len(), n),
        ("z", z.len(), n),
        ("w", w.len(), p.dim as usize),
        ("out", out.len(), n),
    ];
    if m.fits("rms_norm_gated", &checks) {
        let args = [Arg::Bytes(bytes_of(p)), x.arg(), z.arg(), w.arg(), out.arg()];
        m.encode(Fixed::RmsNormGated, &args, rows(p));
    }
}

/// x += y, then out = rms_norm(x, w), in one pass (`add_rms_norm`).
pub fn add_rms_norm<X: Executor>(
    m: &Metal<X>,
    p: &RmsNormParams,
    x: &mut MetalBuf<X>,
    y: &MetalBuf<X>,
    w: &MetalBuf<X>,
    out: &mut MetalBuf<X>,
) {
    let n = (p.rows * p.dim) as usize;
    let checks = [
        ("x", x.len(), n),
        ("y", y.len(), n),
        ("w", w.len(), p.dim as usize),
        ("out", out.len(), n),
    ];
    if m.fits("add_rms_norm", &checks) {
        let args = [Arg::Bytes(bytes_of(p)), x.arg(), y.arg(), w.arg(), out.arg()];
        m.encode(Fixed::AddRmsNorm, &args, rows(p));
    }
}

/// x += y + sigmoid(gate[row]) * shared, then out = rms_norm(x, w), in one pass
/// (`add_gated_rms_norm`).
#[allow(clippy::too_many_arguments)]
pub fn add_gated_rms_norm<X: Executor>(
    m: &Metal<X>,
    p: &RmsNormParams,
    x: &mut MetalBuf<X>,
    y: &MetalBuf<X>,
    shared: &MetalBuf<X>,
    gate: &MetalBuf<X>,
    w: &MetalBuf<X>,
    out: &mut MetalBuf<X>,
) {
    let n = (p.rows * p.dim) as usize;
    let checks = [
        ("x", x.len(), n),
        ("y", y.len(), n),
        ("shared", shared.len(), n),
        ("gate", gate.len(), p.rows as usize),
        ("w", w.len(), p.dim as usize),
        ("out", out.len(), n),
    ];
    if m.fits("add_gated_rms_norm", &checks) {
        let args = [
            Arg::Bytes(bytes_of(p)),
            x.arg(),
            y.arg(),
            shared.arg(),
            gate.arg(),
            w.arg(),
            out.arg(),
        ];
        m.encode(Fixed::AddGatedRmsNorm, &args, rows(p));
    }
}

/// One threadgroup per row.
fn rows(p: &RmsNormParams) -> Grid {
    Grid::Groups {
        count: [p.rows, 1, 1],
        size: [norm_threads(p.dim as usize), 1, 1],
    }
}
