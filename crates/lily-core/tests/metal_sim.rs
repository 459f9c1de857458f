//! The simulated Metal device (tools/metal-sim: the real `.metal` sources compiled by clang-19,
//! bounds-checked) as a whole: every kernel compiles, one forward pass of a tiny checkpoint per
//! GPU family (the simulator reporting that family, so the backend picks its kernel variants)
//! against the reference backend, the variants agreeing bit for bit, and the command-stream
//! labels. Each kernel against its reference twin: the `metal_sim` module of each
//! tests/ops_<family>.rs. Skipped (with a message) where clang-19 is absent, unless
//! LILY_REQUIRE_METAL_SIM=1 (CI), where that fails.

#![cfg(unix)]

mod common;
mod gpu_common;
mod metal_common;

use lily_core::backend::{
    cpu::Cpu,
    metal::{sim::Sim, GemmTile, GemvRows, GpuFamily, Metal, StreamLabel, Variants},
    params::RowsParams,
    Backend, StreamKind,
};

use gpu_common::metal_sim as sim;

#[test]
fn every_kernel_is_compiled() {
    if let Some(m) = sim() {
        metal_common::every_kernel_is_compiled(&m);
    }
}

fn sim_family(f: GpuFamily) -> Option<Metal<Sim>> {
    // Skips (or fails under LILY_REQUIRE_METAL_SIM=1) like sim() when clang-19 is missing.
    sim()?;
    Some(Metal::sim_family(f).unwrap())
}

/// One forward pass (40-token prefill with every position's logits, then 3 decode steps) of a
/// tiny 4-bit checkpoint per GPU family, the simulator reporting that family (so `Metal::new`
/// picks its kernel variants from the table), against the reference backend.
#[test]
fn forward_per_family_matches_cpu() {
    if sim().is_none() {
        return;
    }
    let ckpt = metal_common::TinyCheckpoint::write();
    let want = ckpt.logits(&Cpu::reference());
    for f in GpuFamily::ALL {
        let m = sim_family(f).unwrap();
        assert_eq!(m.family(), f);
        assert_eq!(m.variants, Variants::for_family(f), "{f}");
        assert!(
            m.describe().contains(&format!("Apple{}", f.number())),
            "{}",
            m.describe()
        );
        let got = ckpt.logits(&m);
        let worst = metal_common::assert_logits_close(&got, &want, 1.0, &format!("tiny model on {f}"));
        eprintln!(
            "tiny model on {f} ({:?}): max |Δlogit| / max(1, max |logit|) = {worst:.2e}",
            m.variants
        );
    }
}

/// The variants of a kernel sum each output in the same order: in the simulator their results
/// are the same bits (the GEMVs with 2 and 4 rows per simdgroup, the GEMM tiles of 32 and 64
/// rows), through the whole model.
#[test]
fn variants_agree_bit_for_bit() {
    let Some(mut m) = sim() else { return };
    let ckpt = metal_common::TinyCheckpoint::write();
    m.variants = Variants {
        gemv: GemvRows::R2,
        gemm: GemmTile::N32,
    };
    let small = ckpt.logits(&m);
    m.variants = Variants {
        gemv: GemvRows::R4,
        gemm: GemmTile::N64,
    };
    let large = ckpt.logits(&m);
    for (i, (a, b)) in small.iter().zip(&large).enumerate() {
        assert!(
            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "position {i}: r2/n32 and r4/n64 differ"
        );
    }
}

/// The command streams of a forward pass carry the labels the device gives its command
/// buffers: the prefill chunk (with the first 16 rows of logits), two streams of further logits
/// rows, then "lily step 1", "lily step 2", ...
#[test]
fn command_streams_are_labelled() {
    let Some(m) = sim() else { return };
    let ckpt = metal_common::TinyCheckpoint::write();
    m.executor().take_committed_labels();
    ckpt.logits(&m);
    let labels = m.executor().take_committed_labels();
    use StreamLabel::*;
    assert_eq!(
        labels,
        [PrefillChunk, Commands, Commands, Step(1), Step(2), Step(3)],
        "{labels:?}"
    );
    let names: Vec<String> = labels.iter().map(|l| l.to_string()).collect();
    assert_eq!(names[3], "lily step 1");
}

/// A stream's label is what the engine announced at `begin`, not a guess from the token count:
/// one-token work begun as a prefill chunk is labelled one; a host write inside the work (the
/// token ids) keeps the label for the stream that follows; `Other` work is plain commands.
#[test]
fn streams_are_labelled_as_begun() {
    let Some(m) = sim() else { return };
    let p = RowsParams { tokens: 1, dim: 4 };
    let (mut x, y, mut ids) = (m.alloc(4).unwrap(), m.alloc(4).unwrap(), m.alloc_ids(1).unwrap());
    m.executor().take_committed_labels();
    for kind in [StreamKind::Prefill, StreamKind::Decode, StreamKind::Other] {
        m.begin(kind).unwrap();
        m.write_ids(&mut ids, &[0]).unwrap();
        m.add(&p, &mut x, &y);
        m.finish().unwrap();
    }
    m.add(&p, &mut x, &y); // no `begin`: after `finish`, nothing is announced
    m.finish().unwrap();
    use StreamLabel::*;
    assert_eq!(
        m.executor().take_committed_labels(),
        [PrefillChunk, Step(1), Commands, Commands]
    );
}

/// Work past the stream's per-command-buffer budget is committed in pieces, and a prefill's
/// attention is split into query blocks: with a budget so small that every dispatch is a piece
/// and every query token a block, the forward pass gives the same bits, in many command buffers
/// that carry their stream's label.
#[test]
fn long_work_is_committed_in_pieces() {
    let Some(mut m) = sim() else { return };
    let ckpt = metal_common::TinyCheckpoint::write();
    m.executor().take_committed_labels();
    let whole = ckpt.logits(&m);
    let streams = m.executor().take_committed_labels();
    m.piece_seconds = 1e-12;
    let pieces = ckpt.logits(&m);
    let labels = m.executor().take_committed_labels();
    assert_eq!(whole, pieces, "committed in pieces, the same bits");
    assert!(
        labels.len() > 20 * streams.len(),
        "{} pieces for {} streams",
        labels.len(),
        streams.len()
    );
    use StreamLabel::*;
    assert_eq!(labels[0], PrefillChunk);
    // The second run's decode steps are steps 4, 5 and 6 of this backend.
    for n in 4..=6 {
        let count = labels.iter().filter(|l| **l == Step(n)).count();
        assert!(count > 20, "decode step {n}: {count} pieces");
    }
    assert!(
        labels
            .iter()
            .all(|l| matches!(l, PrefillChunk | Commands | Step(4..=6))),
        "{labels:?}"
    );
}
