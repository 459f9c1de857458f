//! The engine on the simulated Metal device: what it does at load and after a device error.
//! - memory: the model's footprint is checked against the GPU's working set
//!   (`LILY_METAL_SIM_WORKING_SET` plays a small GPU): an explicit `max_seq` that does not fit
//!   is a `DeviceError` naming the one that does; without one, `max_seq` is fitted and a note
//!   says so; weights that do not fit at all are an error;
//! - weights wrapped in place or copied as on a Mac, the copied bytes counted;
//! - a command stream that fails part-way (`LILY_METAL_SIM_FAIL_COMMAND`: half its dispatches
//!   run, as after a GPU error) leaves the state untrusted: the engine says so, refuses to go on
//!   until `reset()` or `restore()`, and after either computes what a fresh engine does.
//!
//! The simulator reads those variables when an engine is built: each test sets them under one
//! lock. KV segments are 16 rows here (`LILY_KV_SEGMENT_ROWS`, read once per process, set under
//! the same lock before the first engine), so the memory fit can be tested within the tiny
//! model's 256 positions.

#![cfg(unix)]

mod common;
mod gpu_common;
mod metal_common;

use std::sync::Mutex;

use lily_core::{
    backend::kv_segment_rows,
    engine::{BackendKind, Engine, Options},
    Error,
};
use metal_common::TinyCheckpoint;

static ENV: Mutex<()> = Mutex::new(());

/// An engine on the simulator (prefill chunks of 16 tokens), built with `vars` set.
fn engine(ckpt: &TinyCheckpoint, max_seq: Option<usize>, vars: &[(&str, &str)]) -> lily_core::Result<Engine> {
    engine_on(BackendKind::MetalSim, ckpt, max_seq, vars)
}

fn engine_on(
    backend: BackendKind,
    ckpt: &TinyCheckpoint,
    max_seq: Option<usize>,
    vars: &[(&str, &str)],
) -> lily_core::Result<Engine> {
    let _g = ENV.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY (edition 2021: safe): the variables are only read while ENV is held.
    std::env::set_var("LILY_KV_SEGMENT_ROWS", "16");
    assert_eq!(kv_segment_rows(), 16);
    for (k, v) in vars {
        std::env::set_var(k, v);
    }
    let opts = Options {
        backend,
        max_seq,
        prefill_chunk: Some(16),
        ..Options::default()
    };
    let e = Engine::load(&ckpt.dir, &opts, &mut |_, _| Ok(()));
    for (k, _) in vars {
        std::env::remove_var(k);
    }
    e
}

/// The tiny checkpoint and an engine on it (`max_seq`, no variables set), or `None` where the
/// simulator is not built (`gpu_common::metal_sim` says so; the test then passes).
fn checkpoint_and_engine(max_seq: Option<usize>) -> Option<(TinyCheckpoint, Engine)> {
    let ckpt = TinyCheckpoint::write();
    gpu_common::metal_sim()?;
    let e = engine(&ckpt, max_seq, &[]).unwrap();
    Some((ckpt, e))
}

fn device_error<T>(r: lily_core::Result<T>) -> String {
    match r {
        Err(Error::Device(m)) => m,
        Err(e) => panic!("expected a DeviceError, got {e:?}"),
        Ok(_) => panic!("expected a DeviceError, got Ok"),
    }
}

#[test]
fn max_seq_is_checked_and_fitted_to_the_gpu_memory() {
    let Some((ckpt, full)) = checkpoint_and_engine(None) else {
        return;
    };
    assert_eq!(full.max_seq(), 256, "no limit: the config's max_position_embeddings");
    assert!(
        !full.notes().iter().any(|n| n.contains("max_seq")),
        "{:?}",
        full.notes()
    );
    let f = full.footprint();
    assert_eq!(f.max_seq, 256);
    assert!(f.weights > 300_000 && f.kv > 0 && f.delta_net > 0, "{f:?}");
    // The bf16 KV cache at max_seq is counted, in whole segments of 16 rows.
    let per_token = f.kv / 256;
    assert_eq!(f.kv_dtype, lily_core::backend::KvDtype::BF16);
    let elements = lily_core::model::state::kv_elements_per_token(full.config());
    assert_eq!(per_token, 2 * elements as u64, "2 bytes per element");
    // A GPU with room for 100 tokens of KV cache (the activations of a 16-token chunk stay):
    // 96 tokens (6 segments) fit, 97 would take a seventh.
    let limit = f.total() - 156 * per_token + per_token / 2;
    let limit_s = limit.to_string();
    let small = [("LILY_METAL_SIM_WORKING_SET", limit_s.as_str())];
    let e = engine(&ckpt, None, &small).unwrap();
    assert_eq!(e.max_seq(), 96);
    assert!(e.footprint().total() <= limit);
    let note = e.notes().join("\n");
    assert!(note.contains("max_seq fitted to the device: 96 tokens"), "{note}");
    let msg = device_error(engine(&ckpt, Some(200), &small));
    assert!(msg.contains("max_seq 96 or less fits"), "{msg}");
    assert!(msg.contains("bf16 KV cache"), "{msg}");
    assert!(msg.contains("recommendedMaxWorkingSetSize"), "{msg}");
    assert_eq!(engine(&ckpt, Some(96), &small).unwrap().max_seq(), 96);
    device_error(engine(&ckpt, Some(97), &small));
    let tiny = (f.weights / 2).to_string();
    let msg = device_error(engine(&ckpt, None, &[("LILY_METAL_SIM_WORKING_SET", tiny.as_str())]));
    assert!(msg.contains("not even one token"), "{msg}");
}

/// The tiny checkpoint puts its 4-byte tensors first and its bf16 ones after: a bf16 tensor at
/// an offset that is not a multiple of 4 cannot be wrapped (the device's rule) and is copied.
#[test]
fn copied_weights_are_counted() {
    let Some((ckpt, e)) = checkpoint_and_engine(Some(64)) else {
        return;
    };
    let file = std::fs::read(ckpt.dir.join("model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&file[8..8 + header_len]).unwrap();
    let mut want = 0;
    for t in header.as_object().unwrap().values() {
        let [a, b] = [0, 1].map(|i| t["data_offsets"][i].as_u64().unwrap() as usize);
        if (8 + header_len + a) % 4 != 0 && b > a {
            want += (b - a) as u64;
        }
    }
    assert!(want > 0, "the test needs a misaligned tensor");
    assert_eq!(e.copied_weight_bytes(), want);
    let note = e.notes().join("\n");
    assert!(note.contains("of weights copied to the device"), "{note}");
}

#[test]
fn a_device_error_leaves_the_state_untrusted_until_reset() {
    let Some((ckpt, mut fresh)) = checkpoint_and_engine(Some(64)) else {
        return;
    };
    let (prompt, decode) = TinyCheckpoint::tokens();
    let want = fresh.prefill(&prompt, false).unwrap();
    let want_next = fresh.decode(decode[0]).unwrap();

    // The first command stream (the prompt's forward pass) runs half its dispatches and fails.
    let mut e = engine(&ckpt, Some(64), &[("LILY_METAL_SIM_FAIL_COMMAND", "1")]).unwrap();
    let msg = device_error(e.prefill(&prompt, false));
    assert!(msg.contains("injected") && msg.contains("half-updated"), "{msg}");
    assert!(e.state_error().is_some());
    for r in [e.decode(decode[0]).map(|_| ()), e.prefill(&prompt, false).map(|_| ())] {
        let m = device_error(r);
        assert!(m.contains("not trusted") && m.contains("reset()"), "{m}");
    }
    assert!(e.snapshot().is_err(), "no snapshot of an untrusted state");
    e.reset().unwrap();
    assert_eq!(e.state_error(), None);
    assert_eq!(e.prefill(&prompt, false).unwrap(), want);
    assert_eq!(e.decode(decode[0]).unwrap(), want_next);
}

#[test]
fn restore_brings_back_the_last_good_state() {
    let Some((ckpt, mut fresh)) = checkpoint_and_engine(Some(64)) else {
        return;
    };
    let (prompt, decode) = TinyCheckpoint::tokens();
    fresh.prefill(&prompt, false).unwrap();
    let want = [fresh.decode(decode[0]).unwrap(), fresh.decode(decode[1]).unwrap()];

    // Streams 1-3: the prompt's chunks of 16 tokens; the snapshot copies on the host (no
    // stream); stream 4: the decode step.
    let mut e = engine(&ckpt, Some(64), &[("LILY_METAL_SIM_FAIL_COMMAND", "4")]).unwrap();
    e.prefill(&prompt, false).unwrap();
    let snap = e.snapshot().unwrap();
    device_error(e.decode(decode[0]));
    assert!(e.state_error().is_some());
    // The failed step's KV row is forgotten: a snapshot past the position no longer matches.
    assert_eq!(
        e.cached_prefix(&[prompt.clone(), vec![decode[0]]].concat()),
        prompt.len()
    );
    e.restore(&snap).unwrap();
    assert_eq!(e.state_error(), None);
    assert_eq!(e.position(), prompt.len());
    assert_eq!(e.decode(decode[0]).unwrap(), want[0]);
    assert_eq!(e.decode(decode[1]).unwrap(), want[1]);
}

/// `auto` on Linux picks the CPU and says why; no GPU backend was passed over, so it is no
/// fallback to warn about.
#[cfg(not(target_os = "macos"))]
#[test]
fn auto_says_what_it_picked() {
    let c = lily_core::engine::auto_choice();
    assert_eq!(c.backend, BackendKind::Cpu);
    assert!(!c.fallback);
    assert!(c.reason.contains(std::env::consts::OS), "{}", c.reason);
    let ckpt = TinyCheckpoint::write();
    let e = engine_on(BackendKind::Auto, &ckpt, Some(32), &[]).unwrap();
    assert_eq!(e.backend_name(), "cpu");
    assert_eq!(e.notes(), [format!("backend \"auto\" chose {}", c.reason)]);
}
