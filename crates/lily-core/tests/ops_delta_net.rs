//! The DeltaNet family (delta_net_conv; delta_net: step recurrence and chunked form;
//! delta_net_gated: conv, recurrence and gated norm of a decode step): the CPU
//! kernels and the GPU kernels (Metal and CUDA, simulators and devices: `gpu_tests!`) against the
//! reference twins,
//! the chunked twin against the step recurrence, over many steps and calls that carry state.

mod common;
#[macro_use]
mod gpu_common;

use common::{assert_close, delta_net_inputs, delta_net_params, one_row, one_row_buffers, rand_vec, DeltaNetInputs};
use gpu_common::{assert_near, read_all, TOL};
use lily_core::{
    backend::{
        cpu::Cpu,
        metal::{Executor, Metal},
        params::{ConvParams, DeltaNetParams, RmsNormParams, DELTA_NET_CHUNK, DELTA_NET_KEY_DIM_MAX, MAX_CONV_TAPS},
        Backend, DeltaNetGated, DeltaNetOps,
    },
    ops::delta_net::{cpu::CHUNK, reference, DeltaNetIn},
};

mod cpu {
    use super::*;
    use lily_core::backend::DeltaNetSeq;

    /// A batched decode step's conv and recurrence (`delta_net_batch`: every sequence in one pool
    /// loop per op) against each row run alone through `delta_net_conv` and `delta_net` on its
    /// own states: outputs and both states bit for bit, over steps that carry the states, with
    /// 1, 3 and 5 sequences and 1280 channels (two conv blocks, the second partial).
    #[test]
    fn delta_net_batch_is_each_row_alone() {
        let b = Cpu::new();
        let (hk, hv, dk, dv, taps) = (4, 12, 64, 64, 4);
        let c = 2 * hk * dk + hv * dv;
        let w = rand_vec(c * taps, 1, -0.5, 0.5);
        let (a_log, dt_bias) = (rand_vec(hv, 2, -1.0, 0.5), rand_vec(hv, 3, -0.5, 0.5));
        for n in [1usize, 3, 5] {
            let conv0: Vec<Vec<f32>> = (0..n)
                .map(|i| rand_vec((taps - 1) * c, 10 + i as u64, -1.0, 1.0))
                .collect();
            let ssm0: Vec<Vec<f32>> = (0..n)
                .map(|i| rand_vec(hv * dk * dv, 20 + i as u64, -0.3, 0.3))
                .collect();
            let (mut conv, mut ssm) = (conv0.clone(), ssm0.clone());
            let (mut conv1, mut ssm1) = (conv0, ssm0);
            for step in 0..3u64 {
                let seed = 100 * step + n as u64;
                let proj = rand_vec(n * c, seed, -1.0, 1.0);
                let (a, bb) = (
                    rand_vec(n * hv, seed + 1, -2.0, 2.0),
                    rand_vec(n * hv, seed + 2, -2.0, 2.0),
                );
                let r = DeltaNetOps::<Cpu> {
                    conv: ConvParams {
                        tokens: n as u32,
                        channels: c as u32,
                        taps: taps as u32,
                    },
                    delta: delta_net_params(n, hk, hv, dk, dv),
                    conv1d: &w,
                    a_log: &a_log,
                    dt_bias: &dt_bias,
                    proj: &proj,
                    a: &a,
                    b: &bb,
                };
                let mut seqs: Vec<DeltaNetSeq<'_, Vec<f32>>> = conv
                    .iter_mut()
                    .zip(ssm.iter_mut())
                    .map(|(conv, ssm)| DeltaNetSeq { conv, ssm })
                    .collect();
                let mut row = one_row_buffers(c.max(hv * dv));
                let mut one = one_row(&mut row);
                let (mut mixed, mut core) = (vec![0f32; n * c], vec![0f32; n * hv * dv]);
                b.delta_net_batch(&r, &mut seqs, &mut one, &mut mixed, &mut core)
                    .unwrap();
                for i in 0..n {
                    let (mut mixed1, mut core1) = (vec![0f32; c], vec![0f32; hv * dv]);
                    let conv_p = ConvParams { tokens: 1, ..r.conv };
                    b.delta_net_conv(&conv_p, &w, &mut conv1[i], &proj[i * c..][..c].to_vec(), &mut mixed1);
                    let p1 = delta_net_params(1, hk, hv, dk, dv);
                    let (ai, bi) = (a[i * hv..][..hv].to_vec(), bb[i * hv..][..hv].to_vec());
                    let x = DeltaNetIn::new(&p1, &mixed1, &ai, &bi, &a_log, &dt_bias);
                    b.delta_net(&x, &mut ssm1[i], &mut core1);
                    let what = format!("{n} sequences, step {step}, row {i}");
                    assert!(bits(&core[i * hv * dv..][..hv * dv]) == bits(&core1), "{what}: output");
                    assert!(bits(&conv[i]) == bits(&conv1[i]), "{what}: conv state");
                    assert!(bits(&ssm[i]) == bits(&ssm1[i]), "{what}: recurrent state");
                }
            }
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    fn delta_net_case(t: usize, seed: u64) {
        delta_net_heads_case(t, seed, 2, 4);
    }

    fn delta_net_heads_case(t: usize, seed: u64, hk: usize, hv: usize) {
        let (fast, refr) = (Cpu::new(), Cpu::reference());
        let (dk, dv) = (128usize, 128usize);
        let DeltaNetInputs {
            qkv,
            a,
            b,
            a_log,
            dt_bias,
            s0,
        } = delta_net_inputs(t, [hk, hv, dk, dv], seed);
        let p = delta_net_params(t, hk, hv, dk, dv);
        let (mut sa, mut sb, mut sc) = (s0.clone(), s0.clone(), s0);
        let n = t * hv * dv;
        let (mut oa, mut ob, mut oc) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        let x = DeltaNetIn::new(&p, &qkv, &a, &b, &a_log, &dt_bias);
        fast.delta_net(&x, &mut sa, &mut oa);
        refr.delta_net(&x, &mut sb, &mut ob);
        assert_close(&oa, &ob, 2e-5, &format!("delta_net out t={t}"));
        assert_close(&sa, &sb, 2e-5, &format!("delta_net state t={t}"));
        // The chunked kernel (t > 1) against its own twin, the chunked form in plain loops.
        reference::delta_net_chunked(&x.slices(), &mut sc, &mut oc, CHUNK);
        assert_close(&oa, &oc, 5e-6, &format!("delta_net out t={t} vs the chunked reference"));
        assert_close(
            &sa,
            &sc,
            5e-6,
            &format!("delta_net state t={t} vs the chunked reference"),
        );
    }

    #[test]
    fn delta_net_chunked_matches_step_recurrence() {
        delta_net_case(1, 1); // decode step
        delta_net_case(2, 2);
        delta_net_case(64, 3); // one full chunk
        delta_net_case(150, 4); // 64 + 64 + 22
                                // Decode runs several heads per task (here 3 on two threads, the last run shorter).
        delta_net_heads_case(1, 5, 4, 20);
        delta_net_heads_case(3, 6, 4, 20);
    }

    #[test]
    fn delta_net_decode_steps_match_reference() {
        // Many single steps: state errors compound over tokens.
        let (fast, refr) = (Cpu::new(), Cpu::reference());
        let (hk, hv, dk, dv) = (1usize, 2usize, 128usize, 128usize);
        let width = 2 * hk * dk + hv * dv;
        let p = delta_net_params(1, hk, hv, dk, dv);
        let (a_log, dt_bias) = (rand_vec(hv, 1, -4.0, 0.5), rand_vec(hv, 2, -1.0, 1.0));
        let (mut sa, mut sb) = (vec![0f32; hv * dk * dv], vec![0f32; hv * dk * dv]);
        let (mut oa, mut ob) = (vec![0f32; hv * dv], vec![0f32; hv * dv]);
        for step in 0..64 {
            let qkv = rand_vec(width, 100 + step, -1.0, 1.0);
            let (a, b) = (rand_vec(hv, 200 + step, -2.0, 2.0), rand_vec(hv, 300 + step, -2.0, 2.0));
            let x = DeltaNetIn::new(&p, &qkv, &a, &b, &a_log, &dt_bias);
            fast.delta_net(&x, &mut sa, &mut oa);
            refr.delta_net(&x, &mut sb, &mut ob);
            assert_close(&oa, &ob, 1e-5, &format!("step {step}"));
        }
        assert_close(&sa, &sb, 1e-5, "state after 64 steps");
    }

    #[test]
    fn delta_net_conv_matches_reference() {
        let (fast, refr) = (Cpu::new(), Cpu::reference());
        // 300 channels: one partial channel block; 2500: two full blocks and a partial one. T below,
        // at and above the history length. The most taps a config may ask for (MAX_CONV_TAPS).
        for (c, taps) in [(300, 4), (300, 2), (40, 5), (2500, 4), (40, MAX_CONV_TAPS)] {
            let w = rand_vec(c * taps, 1, -1.0, 1.0);
            for &t in &[1usize, 2, 3, 5, 70] {
                let x = rand_vec(t * c, 2 + t as u64, -2.0, 2.0);
                let st0 = rand_vec((taps - 1) * c, 9, -2.0, 2.0);
                let (mut sa, mut sb) = (st0.clone(), st0);
                let (mut a, mut b) = (vec![0f32; t * c], vec![0f32; t * c]);
                let p = ConvParams {
                    tokens: t as u32,
                    channels: c as u32,
                    taps: taps as u32,
                };
                fast.delta_net_conv(&p, &w, &mut sa, &x, &mut a);
                refr.delta_net_conv(&p, &w, &mut sb, &x, &mut b);
                assert_close(&a, &b, 1e-6, &format!("conv out c={c} taps={taps} t={t}"));
                assert_close(&sa, &sb, 0.0, &format!("conv state c={c} taps={taps} t={t}"));
            }
        }
    }

    /// The chunked twin against the step recurrence (architecture.md 6.1: the same result up to f32
    /// rounding) for chunks of 1 (the step form again), 7 (partial chunks everywhere), 32 (Metal's)
    /// and 64 (the CPU's), from a nonzero state, Hv = 2 Hk, Dk != Dv.
    #[test]
    fn delta_net_chunked_reference_matches_step_recurrence() {
        let (hk, hv, dk, dv) = (1usize, 2usize, 24usize, 40usize);
        let width = 2 * hk * dk + hv * dv;
        for (t, seed) in [(1usize, 11u64), (5, 12), (70, 13), (150, 14)] {
            let qkv = rand_vec(t * width, seed, -1.0, 1.0);
            let (a, b) = (
                rand_vec(t * hv, seed + 1, -3.0, 3.0),
                rand_vec(t * hv, seed + 2, -3.0, 3.0),
            );
            let (a_log, dt_bias) = (rand_vec(hv, seed + 3, -3.0, 0.7), rand_vec(hv, seed + 4, -1.0, 1.0));
            let s0 = rand_vec(hv * dk * dv, seed + 5, -0.5, 0.5);
            let p = delta_net_params(t, hk, hv, dk, dv);
            let x: DeltaNetIn = DeltaNetIn::new(&p, &qkv, &a, &b, &a_log, &dt_bias);
            let (mut s_step, mut o_step) = (s0.clone(), vec![0f32; t * hv * dv]);
            reference::delta_net(&x, &mut s_step, &mut o_step);
            for chunk in [1, 7, 32, 64] {
                let (mut s, mut o) = (s0.clone(), vec![0f32; t * hv * dv]);
                reference::delta_net_chunked(&x, &mut s, &mut o, chunk);
                assert_close(&o, &o_step, 2e-5, &format!("out t={t} chunk={chunk}"));
                assert_close(&s, &s_step, 2e-5, &format!("state t={t} chunk={chunk}"));
            }
        }
    }
}

gpu_tests!(
    delta_net_conv_matches_reference,
    delta_net_matches_reference,
    delta_net_gated_matches_reference,
    delta_net_rejects_unsupported_heads;
    metal: delta_net_chunked_matches_reference;
    cuda: delta_net_scan_matches_reference,
);

// The kernels that hand data between threads through threadgroup (shared) memory again with the
// threads of each threadgroup (block) run in reverse order: a missing barrier changes the result.
// Metal: the chunked prefill's two kernels; delta_net_gated (the conv outputs, the normed q / k and
// the recurrence outputs between its simdgroups). CUDA: delta_net_scan (each token's k and q
// between its warps); delta_net_gated (each token's conv outputs and partial sums between warps,
// and, in reverse block order, another block is the last of each key head); the conv.
#[cfg(unix)]
gpu_module!(metal_sim_reversed, crate::gpu_common::metal_sim_reversed, 1.0;
    delta_net_chunked_matches_reference delta_net_gated_matches_reference);
#[cfg(unix)]
gpu_module!(cuda_sim_reversed, crate::gpu_common::cuda_sim_reversed, 1.0;
    delta_net_scan_matches_reference delta_net_gated_matches_reference delta_net_conv_matches_reference);

/// CUDA's prefill recurrence (`delta_net_prep` + `delta_net_scan`, each value column of S split
/// over 4 lanes) for every call of 2 tokens or more (the step-kernel threshold lowered to 1),
/// against the reference from a nonzero state over calls that carry it, decode steps (the step
/// kernel continuing the scan's state) in between: 2 and 1 value heads per key head, Dk = 16
/// (lanes without rows), Dk = 80 (a lane with a partial share), Dk = Dv = 128 (the model's),
/// Dv = 40 (a partial warp of columns).
fn delta_net_scan_matches_reference<X: lily_core::backend::cuda::Executor>(
    dev: &mut lily_core::backend::cuda::Cuda<X>,
    tolx: f32,
) {
    let saved = dev.gemv_tokens;
    dev.gemv_tokens = 1;
    for (hk, hv, dk, dv, calls) in [
        (2usize, 4usize, 16usize, 16usize, &[2usize, 45, 1, 3][..]),
        (1, 2, 80, 40, &[37, 1, 2][..]),
        (2, 4, 128, 128, &[33, 1, 5][..]),
    ] {
        let shape = DeltaShape {
            hk,
            hv,
            dk,
            dv,
            seed: 90,
        };
        both!(dev, tolx * 1e-4, format!("delta_net scan Dk={dk} Dv={dv}"), b => delta_net_calls(b, &shape, calls));
    }
    dev.gemv_tokens = saved;
}

/// The conv over calls that carry its state from a nonzero one (channels leaving a partial
/// threadgroup or block), with the real model's 4 taps, every count from 2 to the most a
/// config may ask for ([`MAX_CONV_TAPS`], checked when the config is read): every kernel handles
/// that many; one more is an error from `finish`, not a panic or a wrong answer. Calls of 1 to
/// 70 tokens: shorter than the history, one token (decode), and several of CUDA's 32-token tiles
/// with a partial last one (33, 70: the first tile's history from the state, the others' from x).
fn delta_net_conv_matches_reference<B: Backend>(dev: &mut B, tolx: f32) {
    let cases = [(70, 4), (300, 4)]
        .into_iter()
        .chain((2..=MAX_CONV_TAPS).map(|taps| (40, taps)));
    for (c, taps) in cases {
        let w = rand_vec(c * taps, 70, -1.0, 1.0);
        let state0 = rand_vec((taps - 1) * c, 69, -2.0, 2.0);
        both!(dev, tolx * TOL, format!("delta_net_conv {c} channels, taps={taps}"), b => {
            let wb = b.upload(&w).unwrap();
            let mut state = b.upload(&state0).unwrap();
            let mut outs = Vec::new();
            for (i, t) in [5usize, 1, 2, 1, 20, 70, 1, 33, 3].into_iter().enumerate() {
                let x = b.upload(&rand_vec(t * c, 71 + i as u64, -2.0, 2.0)).unwrap();
                let mut out = b.alloc(t * c).unwrap();
                b.delta_net_conv(&ConvParams { tokens: t as u32, channels: c as u32, taps: taps as u32 }, &wb, &mut state, &x, &mut out);
                b.finish().unwrap();
                outs.push(read_all(b, &out, t * c));
            }
            outs.push(read_all(b, &state, (taps - 1) * c));
            outs
        });
    }
    let (c, taps) = (70, MAX_CONV_TAPS + 1);
    let (w, x) = (dev.alloc(c * taps).unwrap(), dev.alloc(c).unwrap());
    let (mut state, mut out) = (dev.alloc((taps - 1) * c).unwrap(), dev.alloc(c).unwrap());
    let p = ConvParams {
        tokens: 1,
        channels: c as u32,
        taps: taps as u32,
    };
    dev.delta_net_conv(&p, &w, &mut state, &x, &mut out);
    let err = dev.finish().unwrap_err().to_string();
    assert!(err.contains("taps"), "{err}");
}

/// Head shapes no kernel handles (value heads not a multiple of the key heads, Dk past
/// `DELTA_NET_KEY_DIM_MAX`, no key heads) are an error from `finish` naming the shape, before any
/// dispatch; the same shared check (`ops::delta_net::delta_net_checks`) guards every GPU backend.
fn delta_net_rejects_unsupported_heads<B: Backend>(dev: &mut B, _tolx: f32) {
    for (hk, hv, dk) in [(2, 3, 16), (1, 2, DELTA_NET_KEY_DIM_MAX + 32), (0, 2, 16)] {
        let p = delta_net_params(2, hk, hv, dk, 16);
        let err = delta_net_error(dev, &p, 2 * (2 * hk * dk + hv * 16));
        assert!(
            err.contains(&format!("{hv} value heads on {hk} key heads of dim {dk}")),
            "{err}"
        );
    }
    // A supported shape with a buffer one element short: the size check names it.
    let (t, hk, hv, dk, dv) = (2, 1, 2, 16, 16);
    let need = t * (2 * hk * dk + hv * dv);
    let err = delta_net_error(dev, &delta_net_params(t, hk, hv, dk, dv), need - 1);
    assert!(
        err.contains(&format!("delta_net: qkv has {} elements, needs {need}", need - 1)),
        "{err}"
    );
}

/// The error `finish` reports after `delta_net` of `p` with a qkv of `qkv_len` elements (the
/// other buffers as long as `p` needs).
fn delta_net_error<B: Backend>(dev: &B, p: &DeltaNetParams, qkv_len: usize) -> String {
    let (t, _, hv, dk, dv) = p.dims();
    let qkv = dev.alloc(qkv_len).unwrap();
    let (a, b) = (dev.alloc(t * hv).unwrap(), dev.alloc(t * hv).unwrap());
    let (a_log, dt_bias) = (dev.alloc(hv).unwrap(), dev.alloc(hv).unwrap());
    let (mut state, mut out) = (dev.alloc(hv * dk * dv).unwrap(), dev.alloc(t * hv * dv).unwrap());
    dev.delta_net(
        &DeltaNetIn::new(p, &qkv, &a, &b, &a_log, &dt_bias),
        &mut state,
        &mut out,
    );
    dev.finish().unwrap_err().to_string()
}

/// Tiny heads (Dk = 16: fewer rows than lanes, warps x lanes), Dv not a multiple of 32 (40: a
/// partial warp of columns), the real head dims (Dk = Dv = 128, 2 value heads per key head) and
/// Dk = 256, from a nonzero state over calls that carry it: a 7-token prefill (the step kernels),
/// a 30-token one (CUDA's prep + scan path for Dk <= 128; Metal's chunked path past its
/// threshold), then decode steps (errors compound over steps).
fn delta_net_matches_reference<B: Backend>(dev: &mut B, tolx: f32) {
    let steps: Vec<usize> = [7, 30].into_iter().chain(std::iter::repeat_n(1, 24)).collect();
    for (hk, hv, dk, dv, calls) in [
        (2usize, 4usize, 16usize, 16usize, &steps[..]),
        (1, 2, 24, 40, &steps[..5]),
        (2, 4, 128, 128, &steps[..4]),
        (1, 1, 256, 32, &[9usize, 20][..]),
    ] {
        let shape = DeltaShape {
            hk,
            hv,
            dk,
            dv,
            seed: 80,
        };
        both!(dev, tolx * 1e-4, format!("delta_net Dk={dk} Dv={dv}"), b => delta_net_calls(b, &shape, calls));
    }
}

/// The chunked DeltaNet prefill (`delta_net_chunk_prep` + `delta_net_chunk`, 32-token chunks)
/// against the step recurrence of the reference and against the chunked twin in 32-token chunks
/// (`reference::delta_net_chunked`), from a nonzero state, over calls that carry
/// the state: T spanning several chunks with a partial last one (70, 40, 45, 33), exactly one
/// chunk (32), T < C (5, 3: the chunk threshold is lowered to 2 so these take the chunked path
/// too) and decode steps in between (the step kernel continuing the chunked path's state).
/// Shapes: 2 and 1 value heads per key head, Dk != Dv, Dv not a multiple of the 16-column state
/// block (40, 24), Dk not a multiple of 32 (48, padded), the real head dims (128) and Dk = 256.
/// Tolerance 1e-4 relative (the chunked form reassociates the sums); the largest error seen is
/// printed.
fn delta_net_chunked_matches_reference<X: Executor>(dev: &mut Metal<X>, tolx: f32) {
    // (Hk, Hv, Dk, Dv, tokens of each call)
    let cases: [(usize, usize, usize, usize, &[usize]); 4] = [
        (1, 2, 16, 40, &[70, 5, 1, 32, 33]),
        (2, 2, 48, 16, &[40, 3]),
        (2, 4, 128, 128, &[45, 1]),
        (1, 1, 256, 24, &[33]),
    ];
    let saved = dev.delta_net_chunk_tokens;
    dev.delta_net_chunk_tokens = 2;
    let mut worst = 0f32;
    for (ci, (hk, hv, dk, dv, calls)) in cases.into_iter().enumerate() {
        let shape = DeltaShape {
            hk,
            hv,
            dk,
            dv,
            seed: 400 + 50 * ci as u64,
        };
        let want = delta_net_calls(&Cpu::reference(), &shape, calls);
        let twin = delta_net_calls_chunked(&shape, calls, DELTA_NET_CHUNK);
        let got = delta_net_calls(&*dev, &shape, calls);
        let what = format!("delta_net chunked Hk={hk} Hv={hv} Dk={dk} Dv={dv} T={calls:?}");
        for (i, ((g, w), c)) in got.iter().zip(&want).zip(&twin).enumerate() {
            assert_near(g, w, tolx * 1e-4, &format!("{what} output {i}"));
            assert_near(
                g,
                c,
                tolx * 1e-4,
                &format!("{what} output {i} vs the chunked reference"),
            );
            let scale = w.iter().fold(1f32, |m, v| m.max(v.abs()));
            worst = worst.max(g.iter().zip(w).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale);
        }
    }
    dev.delta_net_chunk_tokens = saved;
    eprintln!("delta_net chunked: max |Δ| / max(1, max |reference|) = {worst:.2e}");
}

/// `delta_net_gated` (conv, recurrence and gated norm; CUDA: one kernel up to its GEMV token
/// limit, a block per 32 value columns, the last block of each key head writing its q/k conv
/// state and finishing its value heads' norms) against its parts on the reference, over
/// consecutive calls that carry the conv and recurrent states from nonzero ones, for several
/// sequences in turn (each its own states, as a batch's rows): the model's widths (16 key heads,
/// 32 value heads, Dk = Dv = 128, 4 taps: 8 blocks a key head) in decode steps of 1 token and
/// calls of 2 and 8 (the GEMV limit: the fused kernel loops over the tokens); an odd small config
/// (3 value heads per key head, Dk = 24, Dv = 40: a head's second block has 8 columns, 3 taps)
/// including a 12-token call (CUDA: the parts) between fused ones; one value head per key head,
/// 2 taps (a history shorter than some calls); 6 taps (CUDA: the parts). Each call's gated
/// output, then every sequence's final conv and recurrent state.
fn delta_net_gated_matches_reference<B: Backend>(dev: &mut B, tolx: f32) {
    // (Hk, Hv, Dk, Dv, taps, sequences, tokens of each call: call i runs sequence i % sequences)
    type Case = (usize, usize, usize, usize, usize, usize, &'static [usize]);
    let cases: [Case; 4] = [
        (16, 32, 128, 128, 4, 2, &[1, 1, 2, 1, 1, 8, 1, 1]),
        (2, 6, 24, 40, 3, 3, &[1, 3, 1, 1, 12, 1, 1, 2, 1]),
        (1, 1, 16, 16, 2, 1, &[1, 3, 1]),
        // More taps than the CUDA kernel's window (DELTA_NET_GATED_TAPS_MAX): the parts there.
        (1, 2, 16, 16, 6, 1, &[1, 2, 1]),
    ];
    for (ci, (hk, hv, dk, dv, taps, seqs, calls)) in cases.into_iter().enumerate() {
        let seed = 600 + 100 * ci as u64;
        let width = 2 * hk * dk + hv * dv;
        let what = format!("delta_net_gated Hk={hk} Hv={hv} Dk={dk} Dv={dv} taps={taps} T={calls:?}");
        both!(dev, tolx * 1e-4, what, b => {
            let up = |v: Vec<f32>| b.upload(&v).unwrap();
            let (conv1d, a_log) = (up(rand_vec(width * taps, seed, -0.6, 0.6)), up(rand_vec(hv, seed + 1, -3.0, 0.7)));
            let (dt_bias, norm_w) = (up(rand_vec(hv, seed + 2, -1.0, 1.0)), up(rand_vec(dv, seed + 3, 0.5, 1.5)));
            let mut states: Vec<_> = (0..seqs as u64)
                .map(|q| {
                    let conv = up(rand_vec((taps - 1) * width, seed + 10 + q, -2.0, 2.0));
                    (conv, up(rand_vec(hv * dk * dv, seed + 20 + q, -0.5, 0.5)))
                })
                .collect();
            let mut outs = Vec::new();
            for (i, &t) in calls.iter().enumerate() {
                let k = seed + 30 + 5 * i as u64;
                let (proj, a) = (up(rand_vec(t * width, k, -2.0, 2.0)), up(rand_vec(t * hv, k + 1, -2.0, 2.0)));
                let (bb, z) = (up(rand_vec(t * hv, k + 2, -2.0, 2.0)), up(rand_vec(t * hv * dv, k + 3, -2.0, 2.0)));
                let r = DeltaNetGated {
                    ops: DeltaNetOps {
                        conv: ConvParams { tokens: t as u32, channels: width as u32, taps: taps as u32 },
                        delta: delta_net_params(t, hk, hv, dk, dv),
                        conv1d: &conv1d,
                        a_log: &a_log,
                        dt_bias: &dt_bias,
                        proj: &proj,
                        a: &a,
                        b: &bb,
                    },
                    norm: RmsNormParams { rows: (t * hv) as u32, dim: dv as u32, eps: 1e-6 },
                    norm_w: &norm_w,
                    z: &z,
                };
                let (mut mixed, mut core) = (b.alloc(t * width).unwrap(), b.alloc(t * hv * dv).unwrap());
                let mut out = b.alloc(t * hv * dv).unwrap();
                let (conv_state, ssm) = &mut states[i % seqs];
                b.delta_net_gated(&r, conv_state, ssm, &mut mixed, &mut core, &mut out);
                b.finish().unwrap();
                outs.push(read_all(b, &out, t * hv * dv));
            }
            for (conv_state, ssm) in &states {
                outs.push(read_all(b, conv_state, (taps - 1) * width));
                outs.push(read_all(b, ssm, hv * dk * dv));
            }
            outs
        });
    }
}

/// A DeltaNet layer's shape and the seed of its random inputs.
struct DeltaShape {
    hk: usize,
    hv: usize,
    dk: usize,
    dv: usize,
    seed: u64,
}

/// One `delta_net` call's params, qkv, a and b.
type DeltaCall = (DeltaNetParams, Vec<f32>, Vec<f32>, Vec<f32>);

/// The inputs of successive `delta_net` calls of `calls[i]` tokens from a random nonzero state.
struct DeltaCalls {
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    state: Vec<f32>,
    calls: Vec<DeltaCall>,
}

fn delta_inputs(s: &DeltaShape, calls: &[usize]) -> DeltaCalls {
    let (hk, hv, dk, dv, seed) = (s.hk, s.hv, s.dk, s.dv, s.seed);
    let width = 2 * hk * dk + hv * dv;
    let calls = calls
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            let p = delta_net_params(t, hk, hv, dk, dv);
            let k = seed + 10 * (i as u64 + 1);
            let qkv = rand_vec(t * width, k, -1.0, 1.0);
            (
                p,
                qkv,
                rand_vec(t * hv, k + 1, -2.0, 2.0),
                rand_vec(t * hv, k + 2, -2.0, 2.0),
            )
        })
        .collect();
    DeltaCalls {
        // a_log in [-3, 0.7]: per-token decay from about 0.99 (memory across chunks) to e^-6.
        a_log: rand_vec(hv, seed, -3.0, 0.7),
        dt_bias: rand_vec(hv, seed + 1, -1.0, 1.0),
        state: rand_vec(hv * dk * dv, seed + 2, -1.0, 1.0),
        calls,
    }
}

/// `delta_net` on backend `b` over the calls of `delta_inputs`: each call's output, then the
/// final state.
fn delta_net_calls<B: Backend>(b: &B, s: &DeltaShape, calls: &[usize]) -> Vec<Vec<f32>> {
    let c = delta_inputs(s, calls);
    let (al, dt) = (b.upload(&c.a_log).unwrap(), b.upload(&c.dt_bias).unwrap());
    let mut state = b.upload(&c.state).unwrap();
    let mut outs = Vec::new();
    for (p, qkv, a, bb) in &c.calls {
        let n = p.tokens as usize * s.hv * s.dv;
        let (qkv, a, bb) = (b.upload(qkv).unwrap(), b.upload(a).unwrap(), b.upload(bb).unwrap());
        let mut out = b.alloc(n).unwrap();
        b.delta_net(&DeltaNetIn::new(p, &qkv, &a, &bb, &al, &dt), &mut state, &mut out);
        b.finish().unwrap();
        outs.push(read_all(b, &out, n));
    }
    outs.push(read_all(b, &state, c.state.len()));
    outs
}

/// [`delta_net_calls`] through the chunked reference twin in chunks of `chunk` tokens.
fn delta_net_calls_chunked(s: &DeltaShape, calls: &[usize], chunk: usize) -> Vec<Vec<f32>> {
    let mut c = delta_inputs(s, calls);
    let mut outs = Vec::new();
    for (p, qkv, a, b) in &c.calls {
        let mut out = vec![0f32; p.tokens as usize * s.hv * s.dv];
        let x: DeltaNetIn = DeltaNetIn::new(p, qkv, a, b, &c.a_log, &c.dt_bias);
        reference::delta_net_chunked(&x, &mut c.state, &mut out, chunk);
        outs.push(out);
    }
    outs.push(c.state);
    outs
}
