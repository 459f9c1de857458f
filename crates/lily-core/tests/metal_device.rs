//! The real Metal device (macOS, Apple silicon) as a whole: every kernel compiles (shaders
//! compiled by Apple's compiler with `newLibraryWithSource`, fast math on), a tiny checkpoint end
//! to end with each GPU family's kernel variants against the reference backend, weights wrapped
//! without a copy. Each kernel against its reference twin on the device: the `metal_device`
//! module of each tests/ops_<family>.rs. Skipped (with a message) only where Metal lists no
//! device at all, in a virtual machine; a Mac with a Metal device Lily cannot run on (a virtual
//! machine's paravirtual GPU, as on GitHub's hosted runners; an Intel Mac; any GPU below family
//! Apple7) fails with the reason, as does every other error (`gpu_common::metal_device`). The
//! tests sit in a `metal_device` module, as the ops tests' device cases do, so that
//! `cargo test -- --skip metal_device` leaves out every device test (the hosted macOS workflow).

#![cfg(target_os = "macos")]

mod common;
mod gpu_common;
mod metal_common;

mod metal_device {
    use lily_core::{backend::metal::Executor, safetensors::Bytes};

    use crate::{gpu_common::metal_device as device, metal_common};

    #[test]
    fn every_kernel_is_compiled() {
        if let Some(m) = device() {
            metal_common::every_kernel_is_compiled(&m);
        }
    }

    /// A tiny checkpoint end to end with the kernel variants of each GPU family (all run on any
    /// Apple7+ GPU); fast math and the GPU's reduction order: 20x the simulator's tolerances.
    #[test]
    fn forward_per_family_matches_cpu() {
        if let Some(mut m) = device() {
            metal_common::forward_per_family_matches_cpu(&mut m, 20.0);
        }
    }

    /// A checkpoint tensor at a 4-byte-aligned offset inside its mapping is wrapped in place: the
    /// buffer plus the returned binding offset address the mapped bytes themselves.
    #[test]
    fn weights_are_wrapped_without_a_copy() {
        let Some(m) = device() else { return };
        let data = Bytes::from_slice(&vec![7u8; 100_000]).slice(4100, 50_000);
        let p = m.executor().weight_buffer(&data).unwrap();
        assert!(!p.copied, "the weights were copied");
        let addr = m.executor().contents(&p.buf) as usize + p.offset;
        assert_eq!(addr, data.as_slice().as_ptr() as usize, "the weights were copied");
        // 2 bytes off a word boundary: copied, and counted as copied.
        let odd = Bytes::from_slice(&vec![7u8; 100_000]).slice(4098, 50_000);
        assert!(m.executor().weight_buffer(&odd).unwrap().copied);
    }

    /// What the device reports: an Apple7+ GPU with unified memory and a working set, the family
    /// `probe` found, the shaders compiled as MSL 3.0 on macOS 13+.
    #[test]
    fn the_device_is_described() {
        let Some(m) = device() else { return };
        let info = m.executor().info().clone();
        assert_eq!(Some(info.clone()), lily_core::backend::metal::probe().ok());
        assert!(info.unified_memory, "{info:?}");
        assert!(info.working_set > 1 << 30, "{info:?}");
        let ((major, _, _), os) = lily_core::backend::metal::device::macos_version();
        assert!(major >= 13, "{os}");
        eprintln!("{} on {os}: {info:?}", m.describe());
    }
}
