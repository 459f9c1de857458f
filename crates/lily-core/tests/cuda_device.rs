//! CUDA kernels on a real NVIDIA GPU against their plain-loop twins `Cpu::reference()` (those of
//! `cuda_common`, shared with the simulator; the others in the `cuda_device` module of each
//! tests/ops_<family>.rs), the tiny checkpoint end to end, and
//! decode graphs replaying exactly what the launches one by one compute, programmatic dependent
//! launch (sm_90+) computing exactly what serial launches compute. Skipped only where no
//! NVIDIA driver is installed (no /proc/driver/nvidia, no /dev/nvidiactl); any other failure
//! (no NVRTC, a kernel that does not load, a wrong result) fails.

#![cfg(target_os = "linux")]

mod common;
#[macro_use]
mod gpu_common;
#[macro_use]
mod cuda_common;
mod metal_common;

use cuda_common::*;
use gpu_common::cuda_device as gpu;
use lily_core::backend::{cpu::Cpu, cuda::executor::programmatic_launch};

// The GPU's expf / rsqrtf differ from the host's by an ulp or two: a little more room.
all_cuda_tests!(crate::gpu_common::cuda_device, 4.0);

/// Decode steps replayed from a captured graph give the same bits as the same steps launched
/// one by one (graphs off), and a graph is in fact replayed.
#[test]
fn decode_graph_replays_what_eager_launches_compute() {
    let Some(mut dev) = gpu() else { return };
    let ckpt = TinyCheckpoint::write();
    dev.graphs = false;
    let eager = ckpt.logits(&dev);
    dev.graphs = true;
    let graphed = ckpt.logits(&dev);
    assert_eq!(eager, graphed, "graph replay differs from eager launches");
    let want = ckpt.logits(&Cpu::reference());
    metal_common::assert_logits_close(&graphed, &want, 500.0, "tiny model with graphs");
}

/// Decode steps (eager, then replayed from a graph with programmatic edges) launched with
/// programmatic dependent launch give the same bits as the same steps launched serially: the
/// kernels are deterministic, so only a kernel touching memory before its grid_dep_wait() (a race
/// with the kernel before it) could change them. Two engines, so neither replays the other's
/// graph. On a device or driver without it both runs are serial, and the test says so.
#[test]
fn programmatic_launch_computes_what_serial_launches_compute() {
    let Some(pdl) = gpu() else { return };
    let serial = gpu().expect("a second engine on the same GPU");
    let x = pdl.executor();
    let on = x.set_programmatic(true);
    assert_eq!(
        on,
        programmatic_launch(x.arch(), x.driver(), None),
        "programmatic launch on sm_{}",
        x.arch()
    );
    if !on {
        eprintln!(
            "note: sm_{} / driver {}: no programmatic dependent launch, both runs serial",
            x.arch(),
            x.driver()
        );
    }
    assert!(!serial.executor().set_programmatic(false));
    let ckpt = TinyCheckpoint::write();
    let got = ckpt.logits(&pdl);
    let want = ckpt.logits(&serial);
    assert_eq!(got, want, "programmatic dependent launch differs from serial launches");
    let reference = ckpt.logits(&Cpu::reference());
    metal_common::assert_logits_close(&got, &reference, 500.0, "tiny model with programmatic launch");
}
