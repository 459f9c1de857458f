//! The DeltaNet ops on Metal (`shaders/metal/delta_net.metal`): the conv, the step recurrence
//! (decode and short prefills) and the chunked prefill; for a decode step, the conv, the
//! recurrence and the gated output norm as one dispatch (`delta_net_gated`).

use crate::backend::{
    delta_net_gated_unfused,
    metal::{args::bytes_of, ceil_div, stream::Scratch, Arg, Executor, Fixed, Grid, Metal, MetalBuf},
    params::{ConvParams, DELTA_NET_CHUNK, DELTA_NET_COLS},
    DeltaNetGated, DeltaNetIn,
};

/// Tokens up to which `delta_net_gated` runs as one dispatch: its threadgroup of a key head walks
/// the tokens one after another, which beats the parts' wider grids only for decode steps (one
/// token a sequence; a few with speculative or batched rows); as the MoE's `moe_gemm_tokens`.
const GATED_TOKENS: usize = 8;

/// Threads of a `delta_net_gated` threadgroup (a key head): 32 simdgroups, so the model's 256
/// value columns of a key head take 8 rounds of a simdgroup each.
const GATED_THREADS: u32 = 1024;

/// Threadgroup memory every Apple GPU (Apple7+) gives a threadgroup, in bytes.
const THREADGROUP_BYTES: usize = 32 * 1024;

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
    x: &DeltaNetIn<'_, MetalBuf<X>>,
    state: &mut MetalBuf<X>,
    out: &mut MetalBuf<X>,
) {
    let (p, [qkv, a, b, a_log, dt_bias]) = (x.p, x.bufs());
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
        return delta_net_chunked(m, x, state, out);
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
    x: &DeltaNetIn<'_, MetalBuf<X>>,
    state: &mut MetalBuf<X>,
    out: &mut MetalBuf<X>,
) {
    let (p, [qkv, a, b, a_log, dt_bias]) = (x.p, x.bufs());
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

/// `delta_net_gated`: one `delta_net_gated_f32` dispatch (a threadgroup per key head, covering its
/// value heads: the kernel's comment says why) up to [`GATED_TOKENS`] tokens whose staged q, k, v
/// and gates fit in a threadgroup's memory; otherwise, or with `LILY_METAL_FUSED_DELTA_NET=0`, its
/// parts (`delta_net_conv`, `delta_net`, `rms_norm_gated`). The fused dispatch leaves mixed and
/// core alone.
pub fn delta_net_gated<X: Executor>(
    m: &Metal<X>,
    r: &DeltaNetGated<'_, Metal<X>>,
    conv_state: &mut MetalBuf<X>,
    state: &mut MetalBuf<X>,
    mixed: &mut MetalBuf<X>,
    core: &mut MetalBuf<X>,
    out: &mut MetalBuf<X>,
) {
    let (o, p) = (&r.ops, &r.ops.delta);
    let (t, hk, hv, dk, dv) = p.dims();
    // Threadgroup memory: qk [T, 2 Dk], vo [T, G Dv], gates [T, 2 G] (G = Hv / Hk; hk = 0 or a
    // G that is not whole fails the checks below, in the parts).
    let g = hv.checked_div(hk).unwrap_or(0);
    let tg_mem = [4 * t * 2 * dk, 4 * t * g * dv, 4 * t * 2 * g];
    let fused = m.fused_delta_net
        && (1..=GATED_TOKENS).contains(&t)
        && tg_mem.iter().map(|b| b.next_multiple_of(16)).sum::<usize>() <= THREADGROUP_BYTES
        && super::gated_parts_agree(r);
    if !fused {
        return delta_net_gated_unfused(m, r, conv_state, state, mixed, core, out);
    }
    // The parts' own checks (taps, head shapes), then every buffer the kernel reads or writes.
    let checks = match super::gated_checks(r, |b| b.len(), [conv_state.len(), state.len(), out.len()]) {
        Ok(checks) => checks,
        Err(e) => return m.fail(e),
    };
    if !m.fits("delta_net_gated", &checks) {
        return;
    }
    let args = [
        Arg::Bytes(bytes_of(p)),
        Arg::Bytes(bytes_of(&o.conv)),
        Arg::Bytes(bytes_of(&r.norm)),
        o.conv1d.arg(),
        conv_state.arg(),
        o.proj.arg(),
        o.a.arg(),
        o.b.arg(),
        o.a_log.arg(),
        o.dt_bias.arg(),
        r.norm_w.arg(),
        r.z.arg(),
        state.arg(),
        out.arg(),
    ];
    m.encode_tg(
        Fixed::DeltaNetGated,
        &args,
        Grid::Groups {
            count: [hk as u32, 1, 1],
            size: [GATED_THREADS, 1, 1],
        },
        &tg_mem,
    );
}
