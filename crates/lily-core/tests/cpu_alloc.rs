//! Warm decode steps through the CPU engine allocate nothing: one sequence's
//! (`decode_greedy_in`, `decode_in`) and a batched step of several (`decode_batch_greedy`,
//! `decode_batch`), counted on every thread (the caller's lists and the pool's kernels alike).
//! The kernels alone are held by `cpu_simd`'s `decode_kernels_do_not_allocate_once_warm`; this
//! file holds the step around them. One test in this binary, so the count sees only its own work.

#![cfg(unix)]

mod alloc_common;
mod common;
mod gpu_common;
mod metal_common;

use lily_core::{backend::cpu::int8::Precision, engine::Engine};
use metal_common::TinyCheckpoint;

/// The fewest allocations that one of three rounds of `steps` calls of `step` made. A per-step
/// allocation shows in every round; the rare legitimate ones (a sequence's token list doubling,
/// a new KV segment every `seg_rows` positions) and the test harness's own (another thread) do
/// not.
fn fewest_allocations(steps: usize, mut step: impl FnMut()) -> usize {
    (0..3)
        .map(|_| {
            let before = alloc_common::all_allocations();
            for _ in 0..steps {
                step();
            }
            alloc_common::all_allocations() - before
        })
        .min()
        .unwrap_or(0)
}

#[test]
fn warm_decode_steps_do_not_allocate_one_sequence_or_a_batch() {
    // DeltaNet, attention, DeltaNet, attention.
    let ckpt = TinyCheckpoint::with_layers(4, 2);
    for precision in [Precision::Exact, Precision::Fast] {
        let mut e = ckpt.cpu_engine(precision);
        let v = e.vocab_size();
        // Four sequences at their own positions; the batch's tokens are the last step's greedy ids.
        let mut batch: Vec<(usize, u32)> = Vec::new();
        for i in 0..4u32 {
            let s = e.new_sequence().unwrap();
            let prompt: Vec<u32> = (0..1 + 23 * i).map(|t| (t * 31 + 7 * i + 3) % 250).collect();
            e.prefill_in(s, &prompt, false, &mut || Ok(())).unwrap();
            batch.push((s, (5 * i + 1) % 250));
        }
        let (mut ids, mut logits) = (vec![0u32; batch.len()], vec![0f32; batch.len() * v]);
        let mut greedy = |e: &mut Engine, batch: &mut [(usize, u32)]| {
            e.decode_batch_greedy(batch, &mut ids[..batch.len()]).unwrap();
            batch.iter_mut().zip(&ids).for_each(|(b, &id)| b.1 = id);
        };
        for _ in 0..20 {
            greedy(&mut e, &mut batch);
            e.decode_batch(&batch, &mut logits).unwrap();
        }
        let n = fewest_allocations(8, || greedy(&mut e, &mut batch));
        assert_eq!(
            n, 0,
            "{precision:?}: {n} allocations in 8 warm batched greedy steps of 4 sequences"
        );
        let n = fewest_allocations(8, || e.decode_batch(&batch, &mut logits).unwrap());
        assert_eq!(
            n, 0,
            "{precision:?}: {n} allocations in 8 warm batched steps of 4 sequences"
        );
        // A batch of two of them (fewer rows than the lists have held).
        let n = fewest_allocations(8, || greedy(&mut e, &mut batch[1..3]));
        assert_eq!(
            n, 0,
            "{precision:?}: {n} allocations in 8 warm batched steps of 2 sequences"
        );

        let (s, mut token) = batch[0];
        let n = fewest_allocations(8, || token = e.decode_greedy_in(s, token).unwrap());
        assert_eq!(
            n, 0,
            "{precision:?}: {n} allocations in 8 warm greedy steps of one sequence"
        );
        let n = fewest_allocations(8, || e.decode_in(s, token, &mut logits[..v]).unwrap());
        assert_eq!(n, 0, "{precision:?}: {n} allocations in 8 warm steps of one sequence");
    }
}
