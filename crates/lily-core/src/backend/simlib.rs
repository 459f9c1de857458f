//! What the two simulators (`cuda/sim.rs`, `metal/sim.rs`) share: both compile the backend's own
//! kernel sources with clang-19 against a prelude into shared libraries, cache them by a content
//! hash, and load each library once per process. The simulators differ in what they lower, how
//! they split the sources into libraries and how they run a kernel; this is the rest.

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::{Mutex, MutexGuard},
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

/// One simulator as this module sees it: its name in errors and the environment that
/// configures it.
pub struct Tool {
    /// "cuda-sim": what its errors start with (also its `Executor::NAME`).
    pub name: &'static str,
    /// "CUDA": the device it simulates, in the missing-compiler message.
    pub device: &'static str,
    /// The variable naming the compiler (default `clang++-19`).
    pub cxx_var: &'static str,
    /// The variable naming the library cache, and the cache's directory under the system's
    /// temporary directory otherwise.
    pub cache_var: &'static str,
    pub cache_default: &'static str,
}

/// A library build of one simulator, holding its lock while it lives (one build at a time per
/// simulator and process: concurrent engines and tests then find the cache): the compiler, the
/// cache directory and the start of every cache key (the compiler's version, then the flags).
pub struct Build {
    pub cxx: String,
    pub cache: PathBuf,
    pub key: Fnv,
    _lock: MutexGuard<'static, ()>,
}

impl Tool {
    /// The compiler and its `--version` output (part of every cache key), or why it cannot run:
    /// the one thing a simulator needs from the machine (tests skip for this reason only, and fail
    /// on every other).
    pub fn compiler(&self) -> std::result::Result<(String, Vec<u8>), String> {
        let cxx = std::env::var(self.cxx_var).unwrap_or_else(|_| "clang++-19".into());
        match Command::new(&cxx).arg("--version").output() {
            Ok(out) if out.status.success() => Ok((cxx, out.stdout)),
            Ok(out) => Err(format!("{cxx} --version failed ({})", out.status)),
            Err(e) => Err(format!(
                "the {} simulator needs {cxx} (Debian: apt-get install -y clang-19; or set {}): {e}",
                self.device, self.cxx_var
            )),
        }
    }

    /// Start a build under `lock` (the simulator's own) compiling with `flags`.
    pub fn build(&self, lock: &'static Mutex<()>, flags: &[&str]) -> Result<Build> {
        let guard = lock.lock().unwrap_or_else(|e| e.into_inner());
        let (cxx, version) = self.compiler().map_err(Error::Device)?;
        let cache = std::env::var_os(self.cache_var)
            .map(PathBuf::from)
            .unwrap_or_else(|| std::env::temp_dir().join(self.cache_default));
        let mut key = Fnv::new();
        key.add(&version);
        for f in flags {
            key.add(f.as_bytes());
        }
        Ok(Build {
            cxx,
            cache,
            key,
            _lock: guard,
        })
    }

    /// Run the compiler command `cmd` (`cxx` is its program); a failure is an error naming the
    /// simulator, `failed` ("rms_norm.cu does not compile") and the compiler's first 40 lines of
    /// diagnostics.
    pub fn compile(&self, cxx: &str, failed: &str, cmd: &mut Command) -> Result<()> {
        let out = cmd
            .output()
            .map_err(|e| Error::Device(format!("{}: cannot run {cxx}: {e}", self.name)))?;
        if !out.status.success() {
            return Err(Error::Device(format!(
                "{}: {failed}:\n{}",
                self.name,
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .take(40)
                    .collect::<Vec<_>>()
                    .join("\n")
            )));
        }
        Ok(())
    }

    /// An I/O error on `path`: "cuda-sim: `what` `path`: `e`".
    pub fn io_err(&self, what: &str, path: &Path, e: impl std::fmt::Display) -> Error {
        Error::Device(format!("{}: {what} {}: {e}", self.name, path.display()))
    }

    /// Load a built library once per process and keep it loaded for good: its signal handler and
    /// thread-locals must outlive every backend (no dlclose at teardown).
    #[cfg(unix)]
    pub fn load(&self, so: &Path) -> Result<std::sync::Arc<libloading::Library>> {
        use std::sync::Arc;
        static LIBS: Mutex<Vec<(PathBuf, Arc<libloading::Library>)>> = Mutex::new(Vec::new());
        let mut libs = LIBS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, l)) = libs.iter().find(|(p, _)| p == so) {
            return Ok(l.clone());
        }
        // SAFETY: a library built from our own sources; its initializers are the prelude's only.
        let lib = Arc::new(
            unsafe { libloading::Library::new(so) }
                .map_err(|e| Error::Device(format!("{}: cannot load {}: {e}", self.name, so.display())))?,
        );
        libs.push((so.to_path_buf(), lib.clone()));
        Ok(lib)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const X: Tool = Tool {
        name: "x-sim",
        device: "X",
        cxx_var: "LILY_X_SIM_CXX",
        cache_var: "LILY_X_SIM_CACHE",
        cache_default: "lily-x-sim",
    };

    #[test]
    fn compile_names_the_simulator_the_failure_and_the_diagnostics() {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo 'f.cu:3: error: oops' >&2; exit 1"]);
        let e = X
            .compile("sh", "f.cu does not compile", &mut cmd)
            .unwrap_err()
            .to_string();
        assert!(e.contains("x-sim: f.cu does not compile:\nf.cu:3: error: oops"), "{e}");
        let mut ok = Command::new("true");
        assert!(X.compile("true", "never", &mut ok).is_ok());
        let mut missing = Command::new("/nonexistent/clang");
        let e = X
            .compile("/nonexistent/clang", "never", &mut missing)
            .unwrap_err()
            .to_string();
        assert!(e.contains("x-sim: cannot run /nonexistent/clang"), "{e}");
    }
}
