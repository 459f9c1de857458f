//! CUDA kernels on a real NVIDIA GPU against their plain-loop twins `Cpu::reference()` (those of
//! `cuda_common`, shared with the simulator; the others in the `cuda_device` module of each
//! tests/ops_<family>.rs), the tiny checkpoint end to end, and
//! decode graphs replaying exactly what the launches one by one compute. Skipped only where no
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
use lily_core::backend::cpu::Cpu;

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
