//! The norms on Metal (`shaders/metal/norm.metal`): one threadgroup per row of
//! [`norm_threads`] threads.

use crate::backend::{
    metal::{args::bytes_of, norm_threads, Arg, Executor, Fixed, Grid, Metal, MetalBuf},
    params::RmsNormParams,
};

pub fn rms_norm<X: Executor>(m: &Metal<X>, p: &RmsNormParams, x: &MetalBuf<X>, w: &MetalBuf<X>, out: &mut MetalBuf<X>) {
    let n = (p.rows * p.dim) as usize;
    if !m.fits(
        "rms_norm",
        &[("x", x.len(), n), ("w", w.len(), p.dim as usize), ("out", out.len(), n)],
    ) {
        return;
    }
    let grid = Grid::Groups {
        count: [p.rows, 1, 1],
        size: [norm_threads(p.dim as usize), 1, 1],
    };
    m.encode(
        Fixed::RmsNorm,
        &[Arg::Bytes(bytes_of(p)), x.arg(), w.arg(), out.arg()],
        grid,
    );
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
    if !m.fits(
        "rms_norm_gated",
        &[
            ("x", x.len(), n),
            ("z", z.len(), n),
            ("w", w.len(), p.dim as usize),
            ("out", out.len(), n),
        ],
    ) {
        return;
    }
    let grid = Grid::Groups {
        count: [p.rows, 1, 1],
        size: [norm_threads(p.dim as usize), 1, 1],
    };
    m.encode(
        Fixed::RmsNormGated,
        &[Arg::Bytes(bytes_of(p)), x.arg(), z.arg(), w.arg(), out.arg()],
        grid,
    );
}
