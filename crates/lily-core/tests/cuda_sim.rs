//! Every CUDA kernel run by the simulator (tools/cuda-sim: the real `.cu` sources compiled by
//! clang-19 as C++, bounds-checked, warp collectives and mma.sync emulated) against its
//! plain-loop twin `Cpu::reference()` (the tests are in `cuda_common`, shared with the GPU).
//! Skipped (with a message) where clang-19 is absent, unless LILY_REQUIRE_CUDA_SIM=1 (CI).
//! `CUDA_SIM_SCHED=reverse` reruns them with the threads of each block in reverse order.
//! Also here: the simulator's own checks, planted bugs it must catch.

#![cfg(unix)]

mod common;
#[macro_use]
mod cuda_common;
mod metal_common;

use lily_core::backend::cuda::{sim::Sim, Args, Cuda, Executor, Launch};

fn sim() -> Option<Cuda<Sim>> {
    match Cuda::sim() {
        Ok(c) => Some(c),
        Err(e) if std::env::var("LILY_REQUIRE_CUDA_SIM").is_ok_and(|v| v == "1") => panic!("{e}"),
        Err(e) => {
            eprintln!("SKIPPED: CUDA simulator unavailable: {e}");
            None
        }
    }
}

all_cuda_tests!(sim, 1.0);

// ---- the simulator itself: planted bugs ---------------------------------------------------------

const MUTANTS: &str = include_str!("../../../tools/cuda-sim/mutants/mutants.cu");

fn mutants() -> Option<Sim> {
    sim()?;
    let so = lily_core::backend::cuda::sim::build_library(&[("mutants.cu", MUTANTS)]).unwrap();
    Some(Sim::from_library(&so).unwrap())
}

/// Run kernel `name` over `grid` blocks of `block` threads on `n`-float buffers (input 0..n,
/// output poisoned); the output, or the simulator's error.
fn run(s: &Sim, name: &str, grid: u32, block: u32, n: usize) -> Result<Vec<f32>, String> {
    let x = s.alloc(n * 4, "x").unwrap();
    let out = s.alloc(n * 4, "out").unwrap();
    let input: Vec<u8> = (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect();
    s.write(x, &input).unwrap();
    s.write(out, &vec![0xffu8; n * 4]).unwrap();
    let f = s.function(name).unwrap();
    let mut args = Args::new().ptr(x).ptr(out).push(n as u32);
    let shape = Launch {
        grid: [grid, 1, 1],
        block: [block, 1, 1],
        shared: 0,
    };
    let r = s.launch(&f, name, shape, &mut args).map_err(|e| e.to_string());
    let mut bytes = vec![0u8; n * 4];
    s.read(out, &mut bytes).unwrap();
    s.free(x);
    s.free(out);
    r.map(|_| {
        bytes
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    })
}

/// Block sums of 0..n (64-thread blocks): what every reduction mutant should compute.
fn block_sums(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i / 64 * 64)..((i / 64 + 1) * 64).min(n)).map(|j| j as f32).sum())
        .collect()
}

#[test]
fn sim_runs_the_correct_reduction_in_both_orders() {
    let Some(s) = mutants() else { return };
    for reverse in [false, true] {
        s.set_reverse(Some(reverse));
        assert_eq!(
            run(&s, "block_sum_ok", 2, 64, 128).unwrap(),
            block_sums(128),
            "reverse={reverse}"
        );
    }
}

#[test]
fn sim_catches_a_missing_syncthreads() {
    let Some(s) = mutants() else { return };
    let want = block_sums(128);
    // Forward order happens to work; the reversed order reads shared memory before it is written.
    s.set_reverse(Some(true));
    let got = run(&s, "block_sum_no_barrier", 2, 64, 128).unwrap();
    assert_ne!(got, want, "a missing __syncthreads went unnoticed");
}

#[test]
fn sim_catches_a_wrong_shuffle() {
    let Some(s) = mutants() else { return };
    // A butterfly with a wrong lane mask sums the wrong lanes.
    let got = run(&s, "warp_sum_wrong_xor", 1, 32, 32).unwrap();
    assert_ne!(got[0], (0..32).sum::<i32>() as f32);
    // A shuffle whose mask leaves out lanes that call it is an error, not a silent result.
    let e = run(&s, "warp_sum_partial_mask", 1, 32, 32).unwrap_err();
    assert!(e.contains("__shfl_xor_sync") && e.contains("mask 0x0000ffff"), "{e}");
    // Lanes that returned before a full-mask collective.
    let e = run(&s, "shuffle_after_return", 1, 32, 32).unwrap_err();
    assert!(e.contains("returned"), "{e}");
}

#[test]
fn sim_catches_an_out_of_bounds_write() {
    let Some(s) = mutants() else { return };
    let e = run(&s, "write_past_end", 1, 64, 40).unwrap_err();
    assert!(
        e.contains("out-of-bounds") && e.contains("'out'") && e.contains("argument 1"),
        "{e}"
    );
}

#[test]
fn sim_catches_a_wrong_mma_fragment_index() {
    let Some(s) = mutants() else { return };
    // x holds 0..256 as a 16 x 16 A (row-major) and B (16 x 8 from its first 128 values): the
    // correct kernel matches a plain product, the mutant (fragment registers 1 and 2 swapped)
    // does not.
    let a: Vec<f32> = (0..256).map(|i| i as f32).collect();
    let want: Vec<f32> = (0..128)
        .map(|o| {
            let (r, c) = (o / 8, o % 8);
            (0..16).map(|k| a[r * 16 + k] * a[k * 8 + c]).sum()
        })
        .collect();
    let got = run(&s, "mma_ok", 1, 32, 256).unwrap();
    assert_eq!(&got[..128], &want[..], "the emulated mma.sync");
    let bad = run(&s, "mma_wrong_fragment", 1, 32, 256).unwrap();
    assert_ne!(&bad[..128], &want[..], "a wrong fragment index went unnoticed");
}

// ---- the 16-bit segmented KV cache of issue 13, at the kernel level -----------------------------

use lily_core::backend::{
    cpu::Cpu,
    cuda::{KvDesc, KV_SEGMENT_ROWS},
    params::{AttentionParams, KvStoreParams},
    Backend,
};

fn upload(s: &Sim, v: &[f32]) -> u64 {
    let p = s.alloc(v.len() * 4, "test").unwrap();
    s.write(p, &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
        .unwrap();
    p
}

fn read_f32(s: &Sim, p: u64, n: usize) -> Vec<f32> {
    let mut b = vec![0u8; n * 4];
    s.read(p, &mut b).unwrap();
    b.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn launch(s: &Sim, name: &str, grid: [u32; 3], block: u32, mut args: Args) {
    let f = s.function(name).unwrap();
    let shape = Launch {
        grid,
        block: [block, 1, 1],
        shared: 0,
    };
    s.launch(&f, name, shape, &mut args).unwrap_or_else(|e| panic!("{e}"));
}

/// kv_store writes bf16 / f16 rows (round to nearest even) into segments of 1024 rows reached
/// through a table of segment addresses, across segment boundaries; attention reads them back
/// (widened to f32) for a decode step over 2100 rows (3 segments, split over the keys) and a
/// 3-token prefill; both against the reference on the rounded cache.
#[test]
fn kv_16bit_segments_store_and_attend() {
    let Some(c) = sim() else { return };
    let s = c.executor();
    let (h, kv, hd, rows) = (8usize, 2usize, 64usize, 2100usize);
    let width = kv * hd;
    let k_all = common_rand(rows * width, 300);
    let v_all = common_rand(rows * width, 301);
    for (dtype, round) in [(1u32, bf16 as fn(f32) -> f32), (2, f16)] {
        let segs = rows.div_ceil(KV_SEGMENT_ROWS);
        let make_cache = || -> (Vec<u64>, u64) {
            let bases: Vec<u64> = (0..segs)
                .map(|_| s.alloc(KV_SEGMENT_ROWS * width * 2, "kv segment").unwrap())
                .collect();
            let table = s.alloc(8 * segs, "kv table").unwrap();
            s.write(table, &bases.iter().flat_map(|b| b.to_le_bytes()).collect::<Vec<u8>>())
                .unwrap();
            (bases, table)
        };
        let (kseg, kt) = make_cache();
        let (vseg, vt) = make_cache();
        let kd = KvDesc {
            seg: kt,
            width: width as u32,
            dtype,
        };
        let vd = KvDesc {
            seg: vt,
            width: width as u32,
            dtype,
        };
        let step = s.alloc(16, "step").unwrap();
        // Store rows 0..2097 in two calls (the second starts inside segment 1 and ends in segment 2).
        for (pos0, n) in [(0usize, 1500usize), (1500, rows - 3 - 1500)] {
            s.write(step, &(pos0 as u32).to_le_bytes()).unwrap();
            for (cache, src) in [(kd, &k_all), (vd, &v_all)] {
                let x = upload(s, &src[pos0 * width..(pos0 + n) * width]);
                let p = KvStoreParams {
                    tokens: n as u32,
                    pos0: 0,
                    width: width as u32,
                };
                launch(
                    s,
                    "kv_store",
                    [width.div_ceil(256) as u32, n as u32, 1],
                    256,
                    Args::new().push(p).ptr(step).push(cache).ptr(x),
                );
            }
        }
        // The stored bits are the rounded values.
        for (segs_of, src) in [(&kseg, &k_all), (&vseg, &v_all)] {
            for r in [0usize, 1023, 1024, 2047, 2048, rows - 4] {
                let mut b = vec![0u8; width * 2];
                s.read(
                    segs_of[r / KV_SEGMENT_ROWS] + ((r % KV_SEGMENT_ROWS) * width * 2) as u64,
                    &mut b,
                )
                .unwrap();
                for i in 0..width {
                    let bits = u16::from_le_bytes([b[2 * i], b[2 * i + 1]]);
                    let got = if dtype == 1 {
                        half::bf16::from_bits(bits).to_f32()
                    } else {
                        half::f16::from_bits(bits).to_f32()
                    };
                    assert_eq!(got, round(src[r * width + i]), "dtype {dtype} row {r} col {i}");
                }
            }
        }
        // A 3-token prefill at rows 2097..2100 (stored by the call), then the reference on the
        // rounded cache.
        let (t, pos0) = (3usize, rows - 3);
        s.write(step, &(pos0 as u32).to_le_bytes()).unwrap();
        for (cache, src) in [(kd, &k_all), (vd, &v_all)] {
            let x = upload(s, &src[pos0 * width..rows * width]);
            let p = KvStoreParams {
                tokens: t as u32,
                pos0: 0,
                width: width as u32,
            };
            launch(
                s,
                "kv_store",
                [1, t as u32, 1],
                256,
                Args::new().push(p).ptr(step).push(cache).ptr(x),
            );
        }
        let qg_all = common_rand(t * h * 2 * hd, 302);
        let kr: Vec<f32> = k_all.iter().map(|&x| round(x)).collect();
        let vr: Vec<f32> = v_all.iter().map(|&x| round(x)).collect();
        let p = AttentionParams {
            tokens: t as u32,
            pos0: pos0 as u32,
            heads: h as u32,
            kv_heads: kv as u32,
            head_dim: hd as u32,
            scale: 0.125,
        };
        let mut want = vec![0f32; t * h * hd];
        Cpu::reference().attention(&p, &qg_all, &kr, &vr, &mut want);
        let qg = upload(s, &qg_all);
        let out = s.alloc(t * h * hd * 4, "out").unwrap();
        let pp = AttentionParams { pos0: 0, ..p };
        launch(
            s,
            "attention",
            [kv as u32, t as u32, 1],
            (h / kv * 32) as u32,
            Args::new()
                .push(pp)
                .push(1u32)
                .ptr(step)
                .push(kd)
                .push(vd)
                .ptr(qg)
                .ptr(out),
        );
        common_assert_close(
            &read_f32(s, out, t * h * hd),
            &want,
            2e-5,
            &format!("prefill attention over a dtype-{dtype} cache"),
        );
        // Decode: the last token alone, split over the keys.
        let splits = 32u32;
        s.write(step, &((rows - 1) as u32).to_le_bytes()).unwrap();
        let q1 = upload(s, &qg_all[(t - 1) * h * 2 * hd..]);
        let part = s.alloc(h * splits as usize * (hd + 2) * 4, "partials").unwrap();
        let out1 = s.alloc(h * hd * 4, "out").unwrap();
        let p1 = AttentionParams {
            tokens: 1,
            pos0: 0,
            ..p
        };
        launch(
            s,
            "attention",
            [kv as u32, 1, splits],
            (h / kv * 32) as u32,
            Args::new()
                .push(p1)
                .push(splits)
                .ptr(step)
                .push(kd)
                .push(vd)
                .ptr(q1)
                .ptr(part),
        );
        launch(
            s,
            "attention_reduce",
            [h as u32, 1, 1],
            256,
            Args::new().push(p1).push(splits).ptr(part).ptr(q1).ptr(out1),
        );
        common_assert_close(
            &read_f32(s, out1, h * hd),
            &want[(t - 1) * h * hd..],
            2e-5,
            &format!("decode attention over a dtype-{dtype} cache"),
        );
    }
}

fn bf16(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}
fn f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}
fn common_rand(n: usize, seed: u64) -> Vec<f32> {
    cuda_common::rand(n, seed)
}
fn common_assert_close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    cuda_common::close(a, b, tol, what)
}
