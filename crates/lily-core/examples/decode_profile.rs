//! Where a prefill and a decode step's time goes on the CPU: prefill a context (twice: the second,
//! warm, is timed), run decode steps, and print the per-kernel wall time (per weight matrix for
//! matmuls, with the GB/s each reached; prefill and decode kernels apart).
//!
//! `LILY_CPU_PROFILE=1 cargo run --release -p lily-core --example decode_profile -- MODEL [STEPS] [CONTEXT] [BATCH] [PRECISION] [fill]`
//! (e.g. on `lily synth /tmp/synth4 --layers 4`; pin cores with `taskset` for stable numbers).
//! BATCH > 1: BATCH - 1 more sequences, each prefilled with its own prompt (so each routes to its
//! own experts, as independent requests do), and the steps are batched decode steps over all of
//! them (`Engine::decode_batch`), each sequence fed its own token. PRECISION: the CPU's
//! activation rounding, `exact` (default) or `fast` (one int8 plane, `lily bench --precision`).
//! `fill` (batch 1): reach CONTEXT by `Engine::fill_context` (seeded K/V rows, as `lily.bench.depth`
//! does past its prefilled depths) instead of a timed prefill, so a 128K step profiles in seconds.

use std::{path::Path, time::Instant};

use lily_core::{
    backend::cpu::int8::Precision,
    engine::{BackendKind, Engine, Options},
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let Some(dir) = args.get(1) else {
        return Err("usage: decode_profile MODEL [STEPS=32] [CONTEXT=256] [BATCH=1] [PRECISION=exact] [fill]".into());
    };
    let steps: usize = args.get(2).map_or(Ok(32), |s| s.parse())?;
    let context: usize = args.get(3).map_or(Ok(256), |s| s.parse())?;
    let batch: usize = args.get(4).map_or(Ok(1), |s| s.parse())?;
    let precision = args.get(5).map_or(Ok(Precision::Exact), |s| Precision::parse(s))?;
    let fill = match args.get(6).map(String::as_str) {
        None => false,
        Some("fill") if batch == 1 => true,
        Some(other) => return Err(format!("the 6th argument is `fill` (batch 1 only), not {other:?}").into()),
    };
    if std::env::var("LILY_CPU_PROFILE").is_err() {
        eprintln!("note: set LILY_CPU_PROFILE=1 for the per-kernel table");
    }
    let opts = Options {
        backend: BackendKind::Cpu,
        max_seq: Some(context + steps + 8),
        precision,
        ..Options::default()
    };
    let mut engine = Engine::load(Path::new(dir), &opts, &mut |_, _| Ok(()))?;
    let prompt_len = if fill { context.min(256) } else { context };
    let prompt: Vec<u32> = (1..=prompt_len as u32).collect();
    engine.prefill(&prompt, false)?; // warm-up: maps the weights in
    engine.reset()?;
    if fill {
        engine.fill_context(context, 1)?;
        eprintln!("context {context}: filled (seeded K/V rows, no prefill)");
    } else {
        let t = Instant::now();
        engine.prefill(&prompt, false)?;
        eprintln!(
            "context {context}: {:.1} prefill tok/s (warm)",
            context as f64 / t.elapsed().as_secs_f64()
        );
    }
    let mut seqs = vec![0];
    for i in 1..batch as u32 {
        let s = engine.new_sequence()?;
        let prompt: Vec<u32> = (1..=context as u32).map(|t| t * 7 + i * 1000).collect();
        engine.prefill_in(s, &prompt, false, &mut || Ok(()))?;
        seqs.push(s);
    }
    let pairs: Vec<(usize, u32)> = seqs.iter().map(|&s| (s, 5 + 11 * s as u32)).collect();
    // Greedy, as `lily bench`: only the ids leave the engine.
    let mut ids = vec![0u32; batch];
    let mut step = |engine: &mut Engine| match batch {
        1 => engine.decode_greedy(5).map(drop),
        _ => engine.decode_batch_greedy(&pairs, &mut ids),
    };
    let all = Instant::now();
    for _ in 0..3 {
        step(&mut engine)?; // warm-up
    }
    let t = Instant::now();
    for _ in 0..steps {
        step(&mut engine)?;
    }
    eprintln!(
        "context {context}, batch {batch}: {:.2} aggregate decode tok/s over {steps} steps",
        (batch * steps) as f64 / t.elapsed().as_secs_f64()
    );
    // The profile's decode kernels cover the warm-up steps too: this is their wall time.
    eprintln!(
        "decode: {:.3} s wall for {} steps (3 warm-up)",
        all.elapsed().as_secs_f64(),
        steps + 3
    );
    Ok(())
}
