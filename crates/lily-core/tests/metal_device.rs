//! Every Metal kernel on the real device (macOS, Apple silicon), against its plain-loop twin
//! `Cpu::reference()`: the same tests the simulator runs (`metal_common`), through
//! `Metal<Device>` (shaders compiled by Apple's compiler with `newLibraryWithSource`, fast math
//! on). A machine without a usable Metal device (a VM, a hosted CI runner without GPU access,
//! a pre-M1 GPU) skips with a message, unless LILY_REQUIRE_METAL=1.

#![cfg(target_os = "macos")]

mod common;
#[macro_use]
mod metal_common;

use lily_core::{
    backend::metal::{device::Device, Executor, Metal},
    safetensors::Bytes,
};

use metal_common::device;

// Fast math and the GPU's reduction order: 20x the simulator's tolerances (4e-4 relative).
all_metal_tests!(device, 20.0);
// A tiny checkpoint end to end with the kernel variants of each GPU family (all run on any
// Apple7+ GPU).
metal_common_tests!(device, 20.0; forward_per_family_matches_cpu);

/// A checkpoint tensor at a 4-byte-aligned offset inside its mapping is wrapped in place: the
/// buffer plus the returned binding offset address the mapped bytes themselves.
#[test]
fn weights_are_wrapped_without_a_copy() {
    let Some(m) = device() else { return };
    let data = Bytes::from_slice(&vec![7u8; 100_000]).slice(4100, 50_000);
    let (buf, offset) = m.executor().weight_buffer(&data).unwrap();
    let addr = m.executor().contents(&buf) as usize + offset;
    assert_eq!(addr, data.as_slice().as_ptr() as usize, "the weights were copied");
}
