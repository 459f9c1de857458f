//! What `lily info` reports, for a bug report: this build, the operating system, the backend
//! `auto` picks and why, the Metal GPU (or why there is none), and, for a checkpoint, whether
//! it fits the chosen backend's memory at a `max_seq`. Nothing here builds a backend: it asks
//! what exists and computes the footprint the engine would check at load (the same check,
//! [`crate::engine::fit_max_seq`]).

use std::path::Path;

use crate::{
    backend::{cpu::Cpu, metal, Backend},
    config::ModelConfig,
    engine::{auto_choice, fit_max_seq, AutoChoice, BackendKind, Options},
    error::{Error, Result},
    memory::Footprint,
    weights::Loader,
};

/// This machine as Lily sees it.
#[derive(Clone, Debug)]
pub struct SystemInfo {
    /// The lily-core version.
    pub version: &'static str,
    /// "macOS 14.5 (Version 14.5 (Build 23F79))", "linux x86_64".
    pub os: String,
    pub auto: AutoChoice,
    /// The Metal GPU Lily would run on, or why there is none.
    pub metal: std::result::Result<metal::DeviceInfo, String>,
}

/// This machine: no backend is built.
pub fn system() -> SystemInfo {
    #[cfg(target_os = "macos")]
    let os = {
        let ((major, minor, patch), text) = metal::device::macos_version();
        format!("macOS {major}.{minor}.{patch} ({text}) {}", std::env::consts::ARCH)
    };
    #[cfg(not(target_os = "macos"))]
    let os = format!("{} {}", std::env::consts::OS, std::env::consts::ARCH);
    SystemInfo {
        version: env!("CARGO_PKG_VERSION"),
        os,
        auto: auto_choice(),
        metal: metal::probe(),
    }
}

/// Whether a checkpoint fits a backend's memory at a `max_seq`.
#[derive(Debug)]
pub struct Fit {
    /// The backend checked (`auto` resolved).
    pub backend: BackendKind,
    /// The memory limit checked and what it is; `None`: the backend checks none (the CPU: the
    /// operating system pages).
    pub limit: Option<(u64, &'static str)>,
    /// The engine's verdict at load: `Ok((max_seq, footprint, note))` (a note when `max_seq`
    /// was fitted to the device because none was asked for), or the `DeviceError` it would
    /// raise.
    pub verdict: Result<(usize, Footprint, Option<String>)>,
}

/// The footprint of the checkpoint in `dir` as `opts` would load it, checked as the engine
/// checks it at load. Reads the config and the safetensors headers only.
pub fn fit(dir: &Path, opts: &Options) -> Result<Fit> {
    if !dir.is_dir() {
        return Err(Error::file(dir, "checkpoint folder not found"));
    }
    let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
    opts.check(&cfg)?;
    let weights = Loader::open(dir, &cfg)?.weight_bytes();
    let backend = match opts.backend {
        BackendKind::Auto => auto_choice().backend,
        b => b,
    };
    let (limit, chunk, device): (Option<(u64, &'static str)>, usize, &'static str) = match backend {
        BackendKind::Cpu | BackendKind::CpuReference | BackendKind::Auto => (None, Cpu::new().prefill_chunk(), "cpu"),
        BackendKind::Metal => {
            let gpu = metal::probe().map_err(|why| Error::Device(format!("no Metal GPU: {why}")))?;
            (
                Some((gpu.working_set, metal::WORKING_SET)),
                metal::PREFILL_CHUNK,
                "metal",
            )
        }
        BackendKind::MetalSim => (
            metal::sim_working_set()?.map(|b| (b, metal::WORKING_SET)),
            metal::PREFILL_CHUNK,
            "metal-sim",
        ),
        // The GPU's memory is known only once it is opened: no limit checked here.
        BackendKind::Cuda => (None, crate::backend::cuda::PREFILL_CHUNK, "cuda"),
        BackendKind::CudaSim => (None, crate::backend::cuda::PREFILL_CHUNK, "cuda-sim"),
    };
    let chunk = opts.prefill_chunk.unwrap_or(chunk);
    Ok(Fit {
        backend,
        limit,
        verdict: fit_max_seq(&cfg, weights, opts, chunk, limit, device),
    })
}
