//! Every Metal kernel, run by the simulated Metal device (tools/metal-sim: the real `.metal`
//! sources compiled by clang-19, bounds-checked), against its plain-loop twin
//! `Cpu::reference()` (the tests themselves are in `metal_common`, shared with the real
//! device). Skipped (with a message) where clang-19 is absent, unless LILY_REQUIRE_METAL_SIM=1
//! (CI). `MTL_SCHED=reverse` reruns the kernels with the threads of each group in reverse order.

#![cfg(unix)]

#[macro_use]
mod metal_common;

use lily_core::backend::metal::{sim::Sim, Metal};

fn sim() -> Option<Metal<Sim>> {
    match Metal::sim() {
        Ok(m) => Some(m),
        Err(e) if std::env::var("LILY_REQUIRE_METAL_SIM").is_ok_and(|v| v == "1") => panic!("{e}"),
        Err(e) => {
            eprintln!("SKIPPED: Metal simulator unavailable: {e}");
            None
        }
    }
}

all_metal_tests!(sim, 1.0);

/// The chunked DeltaNet prefill again with the threads of each threadgroup run in reverse order
/// (both of its kernels hand data between threads through threadgroup memory): a missing
/// barrier changes the result.
#[test]
fn delta_net_chunked_reversed_matches_cpu() {
    if let Some(mut m) = sim() {
        m.executor().set_reverse(Some(true));
        metal_common::delta_net_chunked_matches_cpu(&mut m, 1.0);
    }
}
