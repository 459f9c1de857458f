//! Forks share their source's whole KV segments (copy-on-write), on the CPU and on the Metal and
//! CUDA simulators: a fork decodes like an unshared run of the same tokens, a fork that goes
//! back and rewrites rows of a shared segment (reset, then a new prompt) does not disturb its
//! source, and the bytes say what is shared: N forks of a sequence cost N partial segments (and
//! their DeltaNet states), not N copies.
//!
//! KV segments are 16 rows here (`LILY_KV_SEGMENT_ROWS`, read once per process, set before the
//! first engine under a lock), so the tiny model's 40-token prompt spans two whole segments and a
//! partial third.

#![cfg(unix)]

mod common;
mod gpu_common;
mod metal_common;

use std::sync::Mutex;

use lily_core::{
    backend::{kv_segment_rows, KvDtype},
    engine::{BackendKind, Engine, Options, DEFAULT_SEQ},
};
use metal_common::TinyCheckpoint;

static ENV: Mutex<()> = Mutex::new(());

fn engine(ckpt: &TinyCheckpoint, backend: BackendKind) -> Engine {
    let _g = ENV.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY (edition 2021: safe): the variable is only read while ENV is held.
    std::env::set_var("LILY_KV_SEGMENT_ROWS", "16");
    assert_eq!(kv_segment_rows(), 16);
    let opts = Options {
        backend,
        max_seq: Some(128),
        prefill_chunk: Some(16),
        kv_dtype: KvDtype::F32,
        ..Options::default()
    };
    Engine::load(&ckpt.dir, &opts, &mut |_, _| Ok(())).unwrap()
}

/// Logits of `tokens` decoded one by one from the sequence's position.
fn decode(e: &mut Engine, seq: usize, tokens: &[u32]) -> Vec<Vec<f32>> {
    tokens
        .iter()
        .map(|&t| {
            let mut out = vec![0f32; e.vocab_size()];
            e.decode_in(seq, t, &mut out).unwrap();
            out
        })
        .collect()
}

fn assert_close(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let worst = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst <= 1e-5, "{what}: step {i} differs by {worst}");
    }
    assert_eq!(got.len(), want.len());
}

fn forks_share_and_copy_on_write(backend: BackendKind) {
    let ckpt = TinyCheckpoint::write();
    let (prompt, _) = TinyCheckpoint::tokens();
    let other: Vec<u32> = (0..20u32).map(|i| (i * 31 + 7) % 250).collect();
    let (a, b) = ([5u32, 77, 190], [11u32, 3, 201]);

    // Unshared runs: one sequence, reset between them.
    let mut cold = engine(&ckpt, backend);
    cold.prefill(&prompt, false).unwrap();
    let want_a = decode(&mut cold, DEFAULT_SEQ, &a);
    cold.reset().unwrap();
    cold.prefill(&prompt, false).unwrap();
    let want_b = decode(&mut cold, DEFAULT_SEQ, &b);
    cold.reset().unwrap();
    cold.prefill(&other, false).unwrap();
    let want_other = decode(&mut cold, DEFAULT_SEQ, &a);

    let mut e = engine(&ckpt, backend);
    e.prefill(&prompt, false).unwrap();
    let kv = e.kv_bytes(); // 3 segments of 16 rows in every K and V cache
    let full = e.sequence_bytes(DEFAULT_SEQ).unwrap();
    let forks: Vec<usize> = (0..4).map(|_| e.fork(DEFAULT_SEQ).unwrap()).collect();
    // Each fork references the same bytes, two thirds of its KV shared with the source.
    for &f in &forks {
        assert_eq!(e.sequence_bytes(f).unwrap(), full);
        assert_eq!(full - e.sequence_unique_bytes(f).unwrap(), 2 * kv / 3);
    }
    let own = e.sequence_unique_bytes(forks[0]).unwrap();
    let mut all = vec![DEFAULT_SEQ];
    all.extend(&forks);
    assert_eq!(
        e.sequences_bytes(&all).unwrap(),
        full + 4 * own,
        "shared segments counted once"
    );
    assert_eq!(e.sequence_unique_bytes(DEFAULT_SEQ).unwrap(), full - 2 * kv / 3);

    // Fork 1 decodes other tokens than the source; fork 2 goes back to row 0 (reset keeps the
    // first, shared segment) and prefills another prompt into it: copy-on-write.
    assert_close(&decode(&mut e, forks[0], &b), &want_b, "fork 1");
    e.reset_in(forks[1]).unwrap();
    e.prefill_in(forks[1], &other, false, &mut || Ok(())).unwrap();
    assert_close(
        &decode(&mut e, forks[1], &a),
        &want_other,
        "fork 2 after its new prompt",
    );
    assert_close(
        &decode(&mut e, DEFAULT_SEQ, &a),
        &want_a,
        "the source after its forks wrote",
    );
    assert_close(&decode(&mut e, forks[2], &b), &want_b, "fork 3 after the source wrote");

    for &f in &forks {
        e.drop_sequence(f).unwrap();
    }
    assert_eq!(
        e.sequence_unique_bytes(DEFAULT_SEQ).unwrap(),
        e.sequence_bytes(DEFAULT_SEQ).unwrap(),
        "nothing shared once the forks are gone"
    );
}

#[test]
fn cpu_forks_share_and_copy_on_write() {
    forks_share_and_copy_on_write(BackendKind::Cpu);
}

#[test]
fn metal_sim_forks_share_and_copy_on_write() {
    if gpu_common::metal_sim().is_some() {
        forks_share_and_copy_on_write(BackendKind::MetalSim);
    }
}

#[test]
fn cuda_sim_forks_share_and_copy_on_write() {
    if gpu_common::cuda_sim().is_some() {
        forks_share_and_copy_on_write(BackendKind::CudaSim);
    }
}
