//! Batched decode on the CPU (`Engine::decode_batch`: the dense matmuls over the batch's rows, each
//! sequence's DeltaNet conv / recurrence and attention in one batched op per layer): every
//! sequence's logits are bit for bit those of the same token decoded alone, for sequences at
//! different positions, in both precisions, over steps that carry the states; at two hidden sizes
//! (96, and 384 for the x86 fused kernels).

#![cfg(unix)]

mod common;
mod gpu_common;
mod metal_common;

use lily_core::backend::cpu::int8::Precision;
use metal_common::TinyCheckpoint;

fn batched_decode_is_each_sequence_alone(precision: Precision, d: usize) {
    // DeltaNet, attention, DeltaNet, attention; hidden size d.
    let ckpt = TinyCheckpoint::with_width(4, 2, d);
    let mut e = ckpt.cpu_engine(precision);
    let v = e.vocab_size();
    for n in [1usize, 3, 6] {
        let mut seqs = Vec::new();
        let mut twins = Vec::new();
        for i in 0..n {
            let s = e.new_sequence().unwrap();
            // Each at its own position (1 to 136 tokens: one to three key runs of attention).
            let prompt: Vec<u32> = (0..1 + 27 * i as u32)
                .map(|t| (t * 31 + 7 * i as u32 + 3) % 250)
                .collect();
            e.prefill_in(s, &prompt, false, &mut || Ok(())).unwrap();
            twins.push(e.fork(s).unwrap());
            seqs.push(s);
        }
        for step in 0..4u32 {
            let batch: Vec<(usize, u32)> = seqs
                .iter()
                .enumerate()
                .map(|(i, &s)| (s, (7 * i as u32 + 11 * step + 1) % 250))
                .collect();
            let mut got = vec![0f32; n * v];
            e.decode_batch(&batch, &mut got).unwrap();
            for (i, (&twin, &(_, token))) in twins.iter().zip(&batch).enumerate() {
                let mut alone = vec![0f32; v];
                e.decode_in(twin, token, &mut alone).unwrap();
                let row = &got[i * v..][..v];
                let same = row.iter().zip(&alone).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{precision:?}, {n} sequences, step {step}, row {i}: differs from alone"
                );
            }
        }
        for s in seqs.into_iter().chain(twins) {
            e.drop_sequence(s).unwrap();
        }
    }
}

#[test]
fn batched_decode_is_each_sequence_alone_exact() {
    batched_decode_is_each_sequence_alone(Precision::Exact, 96);
}

#[test]
fn batched_decode_is_each_sequence_alone_fast() {
    batched_decode_is_each_sequence_alone(Precision::Fast, 96);
}

/// Hidden size 384: the hidden-input matrices (projections, routed and shared experts' gate /
/// up, lm_head) on the x86 fused kernels, whose fast form reads blocks in pairs (the 96-wide
/// model's 96 columns fit only the 16-byte kernels there).
#[test]
fn batched_decode_is_each_sequence_alone_wide() {
    for precision in [Precision::Fast, Precision::Exact] {
        batched_decode_is_each_sequence_alone(precision, 384);
    }
}
