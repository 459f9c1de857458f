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

/// One threadgroup per row.
fn rows(p: &RmsNormParams) -> Grid {
    Grid::Groups {
        count: [p.rows, 1, 1],
        size: [norm_threads(p.dim as usize), 1, 1],
    }
}
