//! Where a prefill and a decode step's time goes on the CPU: prefill a context (twice: the second,
//! warm, is timed), run decode steps, and print the per-kernel wall time (per weight matrix for
//! matmuls, with the GB/s each reached; prefill and decode kernels apart).
//!
//! `LILY_CPU_PROFILE=1 cargo run --release -p lily-core --example decode_profile -- MODEL [STEPS] [CONTEXT]`
//! (e.g. on `lily synth /tmp/synth4 --layers 4`; pin cores with `taskset` for stable numbers).

use std::{path::Path, time::Instant};

use lily_core::engine::{BackendKind, Engine};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let Some(dir) = args.get(1) else {
        return Err("usage: decode_profile MODEL [STEPS=32] [CONTEXT=256]".into());
    };
    let steps: usize = args.get(2).map_or(Ok(32), |s| s.parse())?;
    let context: usize = args.get(3).map_or(Ok(256), |s| s.parse())?;
    if std::env::var("LILY_CPU_PROFILE").is_err() {
        eprintln!("note: set LILY_CPU_PROFILE=1 for the per-kernel table");
    }
    let mut engine = Engine::new(Path::new(dir), BackendKind::Cpu, Some(context + steps + 8))?;
    let prompt: Vec<u32> = (1..=context as u32).collect();
    engine.prefill(&prompt, false)?; // warm-up: maps the weights in
    engine.reset()?;
    let t = Instant::now();
    engine.prefill(&prompt, false)?;
    eprintln!(
        "context {context}: {:.1} prefill tok/s (warm)",
        context as f64 / t.elapsed().as_secs_f64()
    );
    for _ in 0..3 {
        engine.decode(5)?; // warm-up
    }
    let t = Instant::now();
    for _ in 0..steps {
        engine.decode(5)?;
    }
    eprintln!(
        "context {context}: {:.2} decode tok/s over {steps} steps",
        steps as f64 / t.elapsed().as_secs_f64()
    );
    Ok(())
}
