//! `LILY_CPU_PROFILE=1`: wall time (CPU time with `LILY_BENCH_CLOCK=cpu`) per kernel (per weight
//! matrix for matmuls), printed to stderr when the backend is dropped. A developer's tool: off, it costs one branch per call;
//! on, it allocates.
use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicU8, Ordering},
        Mutex,
    },
    time::Instant,
};

use crate::{backend::StreamKind, quant::Matrix};

static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
/// What the work in progress is: a [`StreamKind`] as a number.
static PHASE: AtomicU8 = AtomicU8::new(StreamKind::Other as u8);

/// Note what the work that starts now is (the engine says it at `Backend::begin`).
pub fn phase(kind: StreamKind) {
    PHASE.store(kind as u8, Ordering::Relaxed);
}

fn phase_now() -> StreamKind {
    match PHASE.load(Ordering::Relaxed) {
        k if k == StreamKind::Decode as u8 => StreamKind::Decode,
        k if k == StreamKind::Prefill as u8 => StreamKind::Prefill,
        _ => StreamKind::Other,
    }
}

/// Per phase and kernel: calls, seconds, weight bytes read.
type Table = HashMap<String, (u64, f64, u64)>;
static TABLE: Mutex<Option<Table>> = Mutex::new(None);

pub fn on() -> bool {
    *ON.get_or_init(|| std::env::var("LILY_CPU_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0"))
}

/// `LILY_BENCH_CLOCK=cpu` (as the benches): kernels timed in the process's CPU time, which on a
/// machine shared with other work measures the kernels rather than the waits (with one pool
/// thread it is the kernel's own time; with more, the sum over threads, spinning included).
fn cpu_clock() -> bool {
    static CPU: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CPU.get_or_init(|| std::env::var("LILY_BENCH_CLOCK").is_ok_and(|c| c == "cpu"))
}

/// The process's CPU time in seconds (0 off Unix).
fn cpu_seconds() -> f64 {
    if !cpu_clock() {
        return 0.0;
    }
    #[cfg(unix)]
    {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime writes the timespec it is given.
        unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
        ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
    }
    #[cfg(not(unix))]
    0.0
}

/// Run `f`, adding its wall time (CPU time with `LILY_BENCH_CLOCK=cpu`) (and `bytes` of weights read) under `name` and the phase.
#[inline]
pub fn timed<R>(name: &str, bytes: u64, f: impl FnOnce() -> R) -> R {
    if !on() {
        return f();
    }
    let (t, c) = (Instant::now(), cpu_seconds());
    let r = f();
    let dt = match cpu_clock() {
        true => cpu_seconds() - c,
        false => t.elapsed().as_secs_f64(),
    };
    let mut g = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    let (phase, bytes) = match phase_now() {
        StreamKind::Decode => ("decode", bytes),
        // Weight bytes per second only means something for decode (prefill reuses each weight).
        StreamKind::Prefill => ("prefill", 0),
        StreamKind::Other => ("other", 0),
    };
    let e = g
        .get_or_insert_with(HashMap::new)
        .entry(format!("{phase:7} {name}"))
        .or_default();
    *e = (e.0 + 1, e.1 + dt, e.2 + bytes);
    r
}

/// Run `f`, the product of x with the weight matrices `ws` (one decode GEMV pass over all of
/// them), timed under their names with the bytes they hold: "matmul layers.*.mlp.gate.weight [256
/// x 2048]" for one, "matmuls layers.*.linear_attn.in_proj_qkv.weight + in_proj_z + ..." for
/// several (the first name whole, then each other's last part before ".weight").
#[inline]
pub fn timed_matrices<R>(ws: &[&Matrix], f: impl FnOnce() -> R) -> R {
    if !on() {
        return f();
    }
    let name = match ws {
        [w] => format!("matmul {} [{} x {}]", layerless(&w.name), w.rows, w.cols),
        _ => {
            let short = |w: &&Matrix| {
                let n = w.name.trim_end_matches(".weight");
                n[n.rfind('.').map_or(0, |i| i + 1)..].to_string()
            };
            let rest = ws[1..].iter().map(short).collect::<Vec<_>>().join(" + ");
            format!("matmuls {} + {rest}", layerless(&ws[0].name))
        }
    };
    let bytes = ws.iter().map(|w| (w.rows * w.bytes_per_row()) as u64).sum();
    timed(&name, bytes, f)
}

/// `name` with its layer number replaced by `*`, so every layer's matrix shares one row.
fn layerless(name: &str) -> String {
    match name.find("layers.") {
        Some(i) => {
            let rest = &name[i + 7..];
            let digits = rest.chars().take_while(char::is_ascii_digit).count();
            format!("{}layers.*{}", &name[..i], &rest[digits..])
        }
        None => name.to_string(),
    }
}

/// Print and clear the table, slowest first.
pub fn report() {
    let Some(t) = TABLE.lock().unwrap_or_else(|e| e.into_inner()).take() else {
        return;
    };
    let mut rows: Vec<_> = t.into_iter().collect();
    rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
    let total: f64 = rows.iter().map(|r| r.1 .1).sum();
    eprintln!("lily cpu profile: {total:.3} s in kernels");
    // Per phase: against the phase's wall time, what is left is time between kernels (pool
    // fork-joins, serial host work).
    for phase in ["prefill", "decode", "other"] {
        let s: f64 = rows.iter().filter(|r| r.0.starts_with(phase)).map(|r| r.1 .1).sum();
        if s > 0.0 {
            eprintln!("  {phase}: {s:.3} s in kernels");
        }
    }
    eprintln!("{:>9} {:>7} {:>10} {:>7}  kernel", "ms", "%", "calls", "GB/s");
    for (name, (calls, secs, bytes)) in rows {
        let gbs = if bytes > 0 {
            format!("{:.1}", bytes as f64 / secs / 1e9)
        } else {
            "-".into()
        };
        eprintln!(
            "{:9.1} {:6.1}% {calls:10} {gbs:>7}  {name}",
            1e3 * secs,
            100.0 * secs / total
        );
    }
}
