//! What the GPU kernel tests share, for every GPU backend: the four devices under test (the
//! Metal simulator and device, the CUDA simulator and device), `gpu_tests!` (one generic test
//! body per op, run on each of them with its tolerance factor), and the helpers of a test body
//! (`both!`: the reference and the backend under test on one body; buffers and ids read back).
//! A test crate that uses it declares `mod common;` too.

#![allow(dead_code, unused_macros)] // each test binary uses the subset it needs

use lily_core::backend::{cpu::Cpu, cuda::Cuda, metal::Metal, Backend};

// ---- the devices: each `None` (with a message) only for the one reason it may skip ----------

/// The simulated Metal device (tools/metal-sim: the real `.metal` sources compiled by clang-19,
/// bounds-checked). `None` (with a message) only where the compiler is absent, and then a
/// failure under LILY_REQUIRE_METAL_SIM=1 (CI); any other error (a shader that does not compile,
/// a library that does not load) fails the test.
#[cfg(unix)]
pub fn metal_sim() -> Option<Metal<lily_core::backend::metal::sim::Sim>> {
    simulator(
        "Metal",
        "LILY_REQUIRE_METAL_SIM",
        lily_core::backend::metal::sim::compiler(),
        Metal::sim,
    )
}

/// The real Metal device (Apple silicon, GPU family Apple7+). `None` (with a message) only where
/// Metal lists no device at all (`device::any_device`) and this Mac is a virtual machine
/// (`device::in_virtual_machine`), unless LILY_REQUIRE_METAL=1. Everything else fails the test,
/// with the reason: a Metal device Lily cannot run on (a virtual machine's paravirtual GPU, as on
/// GitHub's hosted runners; an Intel Mac's GPU; any GPU below family Apple7), no device listed on
/// Mac hardware (every Mac that runs macOS 13 has a Metal GPU: discovery is broken, say the
/// CoreGraphics link missing), and a GPU that is found but fails (a shader the compiler rejects,
/// a pipeline, an old macOS).
#[cfg(target_os = "macos")]
pub fn metal_device() -> Option<Metal<lily_core::backend::metal::device::Device>> {
    use lily_core::backend::metal::device::{any_device, in_virtual_machine};
    if let Err(why) = lily_core::backend::metal::probe() {
        let (vm, listed) = (in_virtual_machine(), any_device());
        let required = std::env::var("LILY_REQUIRE_METAL").is_ok_and(|v| v == "1");
        if listed {
            panic!(
                "this Mac has a Metal device, but none of GPU family Apple7 or later, which Lily's kernels \
                 need (an M1 or newer; a virtual machine's paravirtual GPU and an Intel Mac's GPU are below \
                 it). This machine: {}, virtual machine: {vm}. {why}",
                std::env::consts::ARCH
            );
        }
        if !vm {
            panic!("Metal lists no device on this Mac's hardware, which has a Metal GPU: discovery is broken: {why}");
        }
        if required {
            panic!("LILY_REQUIRE_METAL=1, and this virtual machine has no Metal device: {why}");
        }
        eprintln!("SKIPPED: no Metal device at all in this virtual machine: {why}");
        return None;
    }
    Some(Metal::device().unwrap_or_else(|e| panic!("this Mac has a Metal GPU, but the backend fails: {e}")))
}

/// The simulated CUDA device (tools/cuda-sim: the real `.cu` sources compiled by clang-19 as C++,
/// bounds-checked, warp collectives and mma.sync emulated; `CUDA_SIM_SCHED=reverse` runs the
/// threads of each block in reverse order). `None` (with a message) only where the compiler is
/// absent, and then a failure under LILY_REQUIRE_CUDA_SIM=1 (CI); any other error (a kernel that
/// does not compile or is not found in the library) fails the test.
#[cfg(unix)]
pub fn cuda_sim() -> Option<Cuda<lily_core::backend::cuda::sim::Sim>> {
    simulator(
        "CUDA",
        "LILY_REQUIRE_CUDA_SIM",
        lily_core::backend::cuda::sim::compiler(),
        Cuda::sim,
    )
}

/// A simulator (`name`) made by `make`: `None` (with a message) only where its `compiler` lookup
/// failed, and then a failure where `require`=1.
#[cfg(unix)]
fn simulator<B, C>(
    name: &str,
    require: &str,
    compiler: Result<C, String>,
    make: impl FnOnce() -> lily_core::error::Result<B>,
) -> Option<B> {
    if let Err(why) = compiler {
        if std::env::var(require).is_ok_and(|v| v == "1") {
            panic!("{require}=1: {why}");
        }
        eprintln!("SKIPPED: no {name} simulator: {why}");
        return None;
    }
    Some(make().unwrap_or_else(|e| panic!("the {name} simulator's compiler is here, but: {e}")))
}

/// A real NVIDIA GPU. `None` (with a message) only where no NVIDIA driver is installed (no
/// /proc/driver/nvidia, no /dev/nvidiactl); any other failure (no NVRTC, a kernel that does not
/// load) fails the test.
#[cfg(target_os = "linux")]
pub fn cuda_device() -> Option<Cuda<lily_core::backend::cuda::device::Device>> {
    if !["/proc/driver/nvidia", "/dev/nvidiactl"]
        .iter()
        .any(|p| std::path::Path::new(p).exists())
    {
        eprintln!("SKIPPED: no NVIDIA driver on this machine");
        return None;
    }
    Some(Cuda::device().unwrap_or_else(|e| panic!("{e}")))
}

/// [`metal_sim`] running the threads of each threadgroup in reverse order: a kernel that hands
/// data between threads through threadgroup memory without a barrier gets another result.
#[cfg(unix)]
pub fn metal_sim_reversed() -> Option<Metal<lily_core::backend::metal::sim::Sim>> {
    metal_sim().inspect(|m| m.executor().set_reverse(Some(true)))
}

/// [`cuda_sim`] running the threads of each block in reverse order (as `CUDA_SIM_SCHED=reverse`).
#[cfg(unix)]
pub fn cuda_sim_reversed() -> Option<Cuda<lily_core::backend::cuda::sim::Sim>> {
    cuda_sim().inspect(|c| c.executor().set_reverse(Some(true)))
}

/// `#[test]`s for the GPU cases of an op family's test file. Each case is a function of the
/// backend under test and a tolerance factor `tolx` (it checks the backend against the reference
/// with its tolerances times `tolx`). The generic cases (`fn name<B: Backend>(dev: &mut B, tolx)`)
/// run in every module below; the cases after `metal:` (`fn name<X>(dev: &mut Metal<X>, tolx)`)
/// only on Metal, those after `cuda:` only on CUDA:
///
/// ```text
/// metal_sim     (unix)   the Metal simulator   tolx 1
/// metal_device  (macOS)  the Metal GPU         tolx 20 (fast math, the GPU's reduction order)
/// cuda_sim      (unix)   the CUDA simulator    tolx 1
/// cuda_device   (Linux)  an NVIDIA GPU         tolx 4  (expf / rsqrtf an ulp or two off the host's)
/// ```
macro_rules! gpu_tests {
    ($($name:ident),* $(,)? $(; metal: $($m:ident),* $(,)?)? $(; cuda: $($c:ident),* $(,)?)?) => {
        #[cfg(unix)]
        gpu_module!(metal_sim, crate::gpu_common::metal_sim, 1.0; $($name)* $($($m)*)?);
        #[cfg(target_os = "macos")]
        gpu_module!(metal_device, crate::gpu_common::metal_device, 20.0; $($name)* $($($m)*)?);
        #[cfg(unix)]
        gpu_module!(cuda_sim, crate::gpu_common::cuda_sim, 1.0; $($name)* $($($c)*)?);
        #[cfg(target_os = "linux")]
        gpu_module!(cuda_device, crate::gpu_common::cuda_device, 4.0; $($name)* $($($c)*)?);
    };
}

/// One module of `gpu_tests!`: a `#[test]` per case on the device `$dev()` returns.
macro_rules! gpu_module {
    ($module:ident, $dev:path, $tolx:expr; $($name:ident)*) => {
        mod $module {
            $(
                #[test]
                fn $name() {
                    if let Some(mut dev) = $dev() {
                        super::$name(&mut dev, $tolx);
                    }
                }
            )*
        }
    };
}

/// Run `$body` with `$b` bound to the CPU reference and then to the backend under test `$dev`;
/// compare every returned vector (`assert_near`).
macro_rules! both {
    ($dev:expr, $tol:expr, $what:expr, $b:ident => $body:expr) => {{
        let want: Vec<Vec<f32>> = {
            let $b = &lily_core::backend::cpu::Cpu::reference();
            $body
        };
        let got: Vec<Vec<f32>> = {
            let $b = &*$dev;
            $body
        };
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            $crate::gpu_common::assert_near(g, w, $tol, &format!("{} output {i}", $what));
        }
    }};
}

/// The tolerance of most GPU kernels against the reference (relative, at tolx 1).
pub const TOL: f32 = 2e-5;

/// max |a - b| <= tol * max(1, max |b|), and no NaN.
pub fn assert_near(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
    let (mut worst, mut at) = (0f32, 0);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{what}: non-finite value {g} at {i} (reference {w})");
        let e = (g - w).abs();
        if e > worst {
            (worst, at) = (e, i);
        }
    }
    assert!(
        worst <= tol * scale,
        "{what}: max |Δ| = {worst:e} at {at} (got {}, want {}), tolerance {:e}",
        got[at],
        want[at],
        tol * scale
    );
}

pub fn read_all<B: Backend>(b: &B, buf: &B::Buf, n: usize) -> Vec<f32> {
    let mut v = vec![0f32; n];
    b.read(buf, 0, &mut v).unwrap();
    v
}

pub fn ids_buf<B: Backend>(b: &B, ids: &[u32]) -> B::Ids {
    let mut buf = b.alloc_ids(ids.len()).unwrap();
    b.write_ids(&mut buf, ids).unwrap();
    buf
}

/// Reads ids back, on any backend (the GPU backends keep them in float buffers, bit for bit).
pub trait ReadIds: Backend {
    fn ids(&self, b: &Self::Ids) -> Vec<u32>;
}
impl ReadIds for Cpu {
    fn ids(&self, b: &Vec<u32>) -> Vec<u32> {
        b.clone()
    }
}
impl<X: lily_core::backend::metal::Executor> ReadIds for Metal<X> {
    fn ids(&self, b: &Self::Ids) -> Vec<u32> {
        float_ids(self, b, b.len())
    }
}
impl<X: lily_core::backend::cuda::Executor> ReadIds for Cuda<X> {
    fn ids(&self, b: &Self::Ids) -> Vec<u32> {
        float_ids(self, b, b.len())
    }
}
fn float_ids<B: Backend>(b: &B, buf: &B::Buf, n: usize) -> Vec<u32> {
    read_all(b, buf, n).iter().map(|x| x.to_bits()).collect()
}
