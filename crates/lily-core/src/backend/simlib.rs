//! What the two simulators (`cuda/sim.rs`, `metal/sim.rs`) share: both compile the backend's own
//! kernel sources with clang-19 against a prelude into shared libraries, cache them by a content
//! hash, and load each library once per process. The simulators differ in what they lower, how
//! they split the sources into libraries and how they run a kernel; this is the rest.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use crate::error::{Error, Result};

/// FNV-1a, 64 bit: a stable content hash for the cache keys of compiled kernels (the simulators'
/// libraries, NVRTC's cubins).
#[derive(Clone, Copy)]
pub struct Fnv(pub u64);
impl Fnv {
    pub fn new() -> Self {
        Fnv(0xcbf29ce484222325)
    }
    pub fn add(&mut self, bytes: &[u8]) {
        for &b in bytes.iter().chain(&[0xffu8]) {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x100000001b3);
        }
    }
}

impl Default for Fnv {
    fn default() -> Self {
        Fnv::new()
    }
}

/// A simulator's compiler (`$cxx_var`, default `clang++-19`) and its `--version` output (part
/// of every cache key), or why it cannot run: the one thing a simulator needs from the machine
/// (tests skip for this reason only, and fail on every other). `device` names the simulator in
/// the message ("CUDA", "Metal").
pub fn compiler(cxx_var: &str, device: &str) -> std::result::Result<(String, Vec<u8>), String> {
    let cxx = std::env::var(cxx_var).unwrap_or_else(|_| "clang++-19".into());
    match Command::new(&cxx).arg("--version").output() {
        Ok(out) if out.status.success() => Ok((cxx, out.stdout)),
        Ok(out) => Err(format!("{cxx} --version failed ({})", out.status)),
        Err(e) => Err(format!(
            "the {device} simulator needs {cxx} (Debian: apt-get install -y clang-19; or set {cxx_var}): {e}"
        )),
    }
}

/// The library cache: `$cache_var`, else `<tmp>/<default>`.
pub fn cache_dir(cache_var: &str, default: &str) -> PathBuf {
    std::env::var_os(cache_var)
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join(default))
}

/// Run the compiler command `cmd` (`cxx` is its program); a failure is an error of simulator
/// `sim` ("cuda-sim"): `failed` ("rms_norm.cu does not compile") and the compiler's first 40
/// lines of diagnostics.
pub fn compile(sim: &str, cxx: &str, failed: &str, cmd: &mut Command) -> Result<()> {
    let out = cmd
        .output()
        .map_err(|e| Error::Device(format!("{sim}: cannot run {cxx}: {e}")))?;
    if !out.status.success() {
        return Err(Error::Device(format!(
            "{sim}: {failed}:\n{}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .take(40)
                .collect::<Vec<_>>()
                .join("\n")
        )));
    }
    Ok(())
}

/// An I/O error of simulator `sim` on `path`: "`sim`: `what` `path`: `e`".
pub fn dev_err(sim: &str, what: &str, path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Device(format!("{sim}: {what} {}: {e}", path.display()))
}

/// Load a built library once per process and keep it loaded for good: its signal handler and
/// thread-locals must outlive every backend (no dlclose at teardown).
#[cfg(unix)]
pub fn load(sim: &str, so: &Path) -> Result<std::sync::Arc<libloading::Library>> {
    use std::sync::{Arc, Mutex};
    static LIBS: Mutex<Vec<(PathBuf, Arc<libloading::Library>)>> = Mutex::new(Vec::new());
    let mut libs = LIBS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, l)) = libs.iter().find(|(p, _)| p == so) {
        return Ok(l.clone());
    }
    // SAFETY: a library built from our own sources; its initializers are the prelude's only.
    let lib = Arc::new(
        unsafe { libloading::Library::new(so) }
            .map_err(|e| Error::Device(format!("{sim}: cannot load {}: {e}", so.display())))?,
    );
    libs.push((so.to_path_buf(), lib.clone()));
    Ok(lib)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compile_names_the_simulator_the_failure_and_the_diagnostics() {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo 'f.cu:3: error: oops' >&2; exit 1"]);
        let e = compile("x-sim", "sh", "f.cu does not compile", &mut cmd)
            .unwrap_err()
            .to_string();
        assert!(e.contains("x-sim: f.cu does not compile:\nf.cu:3: error: oops"), "{e}");
        let mut ok = Command::new("true");
        assert!(compile("x-sim", "true", "never", &mut ok).is_ok());
        let mut missing = Command::new("/nonexistent/clang");
        let e = compile("x-sim", "/nonexistent/clang", "never", &mut missing)
            .unwrap_err()
            .to_string();
        assert!(e.contains("x-sim: cannot run /nonexistent/clang"), "{e}");
    }
}
