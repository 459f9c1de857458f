//! The DeltaNet ops on Metal (`shaders/metal/delta_net.metal`): the conv, the step recurrence
//! (decode and short prefills) and the chunked prefill.

use crate::backend::{
    metal::{args::bytes_of, ceil_div, stream::Scratch, Arg, Executor, Fixed, Grid, Metal, MetalBuf},
    params::{ConvParams, DeltaNetParams, DELTA_NET_CHUNK, DELTA_NET_COLS},
};

pub fn delta_net_conv<X: Executor>(
    m: &Metal<X>,
    p: &ConvParams,
    w: &MetalBuf<X>,
    state: &mut MetalBuf<X>,
    x: &MetalBuf<X>,
    out: &mut MetalBuf<X>,
) {
    let checks = match super::conv_checks(p, [w.len(), state.len(), x.len(), out.len()]) {
        Ok(checks) => checks,
        Err(e) => return m.fail(e),
    };
    if !m.fits("delta_net_conv", &checks) {
        return;
    }
    let c = p.channels as usize;
    let grid = Grid::Threads {
        threads: [c as u32, 1, 1],
        size: [64, 1, 1],
    };
    m.encode(
        Fixed::DeltaNetConv,
        &[Arg::Bytes(bytes_of(p)), w.arg(), state.arg(), x.arg(), out.arg()],
        grid,
    );
}

pub fn delta_net<X: Executor>(
    m: &Metal<X>,
    p: &DeltaNetParams,
    qkv: &MetalBuf<X>,
    a: &MetalBuf<X>,
    b: &MetalBuf<X>,
    a_log: &MetalBuf<X>,
    dt_bias: &MetalBuf<X>,
    state: &mut MetalBuf<X>,
    out: &mut MetalBuf<X>,
) {
    let (t, hv, dv) = (p.tokens as usize, p.value_heads as usize, p.value_dim as usize);
    let have = [
        qkv.len(),
        a.len(),
        b.len(),
        a_log.len(),
        dt_bias.len(),
        state.len(),
        out.len(),
    ];
    let checks = match super::delta_net_checks(p, have) {
        Ok(checks) => checks,
        Err(e) => return m.fail(e),
    };
    if !m.fits("delta_net", &checks) {
        return;
    }
    if t > 0 && t >= m.delta_net_chunk_tokens as usize {
        return delta_net_chunked(m, p, qkv, a, b, a_log, dt_bias, state, out);
    }
    let args = [
        Arg::Bytes(bytes_of(p)),
        qkv.arg(),
        a.arg(),
        b.arg(),
        a_log.arg(),
        dt_bias.arg(),
        state.arg(),
        out.arg(),
    ];
    m.encode(
        Fixed::DeltaNet,
        &args,
        Grid::Groups {
            count: [ceil_div(dv, 4), hv as u32, 1],
            size: [128, 1, 1],
        },
    );
}

/// f32 elements of the chunked-DeltaNet scratch block of one (value head, chunk), as
/// `dn_layout` in delta_net.metal: -W, Qg, Kd [32, Dkp], U [32, Dvp], M [32, 32], the chunk
/// decay and 3 floats of padding (Dkp, Dvp: Dk, Dv rounded up to 32).
fn delta_net_block(dk: usize, dv: usize) -> usize {
    DELTA_NET_CHUNK * (3 * dk.next_multiple_of(32) + dv.next_multiple_of(32) + DELTA_NET_CHUNK) + 4
}

/// `delta_net` for prefill: the chunked form (architecture.md 6.1) in chunks of
/// [`DELTA_NET_CHUNK`] tokens.
/// `delta_net_chunk_prep` builds every chunk's intra-chunk matrices at once (threadgroups
/// over chunks x value heads) into the DeltaNet scratch, then `delta_net_chunk` carries the
/// state through the chunks in order (threadgroups over 16-column blocks of the state x
/// value heads). The caller has checked the shapes and buffer sizes.
fn delta_net_chunked<X: Executor>(
    m: &Metal<X>,
    p: &DeltaNetParams,
    qkv: &MetalBuf<X>,
    a: &MetalBuf<X>,
    b: &MetalBuf<X>,
    a_log: &MetalBuf<X>,
    dt_bias: &MetalBuf<X>,
    state: &mut MetalBuf<X>,
    out: &mut MetalBuf<X>,
) {
    let (t, hv, dk, dv) = (
        p.tokens as usize,
        p.value_heads as usize,
        p.key_dim as usize,
        p.value_dim as usize,
    );
    let chunks = t.div_ceil(DELTA_NET_CHUNK);
    let need = hv * chunks * delta_net_block(dk, dv);
    let Some(sc) = m.scratch(Scratch::DeltaNetChunk, need) else {
        return;
    };
    let scratch = || sc.part(0, need);
    let pb = || Arg::Bytes(bytes_of(p));
    let args = [pb(), qkv.arg(), a.arg(), b.arg(), a_log.arg(), dt_bias.arg(), scratch()];
    let tile = DELTA_NET_CHUNK * DELTA_NET_CHUNK * 4;
    m.encode_tg(
        Fixed::DeltaNetChunkPrep,
        &args,
        Grid::Groups {
            count: [chunks as u32, hv as u32, 1],
            size: [128, 1, 1],
        },
        &[4 * DELTA_NET_CHUNK * 4, 2 * tile, 2 * tile],
    );
    let state_block = dk.next_multiple_of(32) * DELTA_NET_COLS * 4;
    let cols = DELTA_NET_CHUNK * DELTA_NET_COLS * 4;
    m.encode_tg(
        Fixed::DeltaNetChunk,
        &[pb(), scratch(), state.arg(), out.arg()],
        Grid::Groups {
            count: [ceil_div(dv, DELTA_NET_COLS), hv as u32, 1],
            size: [128, 1, 1],
        },
        &[state_block, cols, cols],
    );
}
