//! Every CUDA kernel on a real NVIDIA GPU against its plain-loop twin `Cpu::reference()` (the
//! tests are in `cuda_common`, shared with the simulator), the tiny checkpoint end to end, and
//! decode graphs replaying exactly what the launches one by one compute. Skipped only where no
//! NVIDIA driver is installed (no /proc/driver/nvidia, no /dev/nvidiactl); any other failure
//! (no NVRTC, a kernel that does not load, a wrong result) fails.

#![cfg(target_os = "linux")]

mod common;
#[macro_use]
mod cuda_common;
mod metal_common;

use lily_core::backend::{
    cpu::Cpu,
    cuda::{device::Device, Cuda},
};

fn gpu() -> Option<Cuda<Device>> {
    if !["/proc/driver/nvidia", "/dev/nvidiactl"]
        .iter()
        .any(|p| std::path::Path::new(p).exists())
    {
        eprintln!("SKIPPED: no NVIDIA driver on this machine");
        return None;
    }
    Some(Cuda::device().unwrap_or_else(|e| panic!("{e}")))
}

// The GPU's expf / rsqrtf differ from the host's by an ulp or two: a little more room.
all_cuda_tests!(gpu, 4.0);

/// Decode steps replayed from a captured graph give the same bits as the same steps launched
/// one by one (graphs off), and a graph is in fact replayed.
#[test]
fn decode_graph_replays_what_eager_launches_compute() {
    let Some(mut dev) = gpu() else { return };
    let ckpt = cuda_common::TinyCheckpoint::write();
    dev.graphs = false;
    let eager = ckpt.logits(&dev);
    dev.graphs = true;
    let graphed = ckpt.logits(&dev);
    assert_eq!(eager, graphed, "graph replay differs from eager launches");
    let want = ckpt.logits(&Cpu::reference());
    metal_common::assert_logits_close(&graphed, &want, 500.0, "tiny model with graphs");
}
