//! Run-time compilation of the CUDA sources with NVRTC, straight to a cubin for one GPU
//! architecture (`sm_XY`), cached on disk.
//!
//! Why a cubin and not PTX: the driver JIT-compiles PTX only up to the PTX version of its own
//! CUDA release, so PTX from an NVRTC newer than the driver (a pip `nvidia-cuda-nvrtc` 13.x on a
//! 12.x driver, say) fails to load; SASS for the device's architecture loads on any driver that
//! supports the device. Compiling at run time keeps one wheel for every GPU and needs no CUDA
//! toolkit to build.
//!
//! Finding NVRTC (it is loaded dynamically; cudarc panics when a library is missing, so every
//! lookup here is checked first and fails with an `Error::Device` that says what to install):
//! `LILY_NVRTC` (the path of `libnvrtc.so*`, set by the Python package when the
//! `nvidia-cuda-nvrtc` wheel is installed), else the CUDA toolkit's usual places, else the
//! loader's search path (`LD_LIBRARY_PATH`). The library found is loaded by path with
//! RTLD_GLOBAL and kept; cudarc's later load by its soname then finds that copy.
//!
//! Cache: `$LILY_CUDA_CACHE`, else `$XDG_CACHE_HOME/lily/cuda`, else `~/.cache/lily/cuda`, one
//! file per source keyed by the sources' hash, the architecture and the NVRTC version.

use std::{
    ffi::{c_char, c_int, CString},
    path::PathBuf,
    sync::OnceLock,
};

use super::kernels::{self, Fnv};
use crate::error::{Error, Result};

/// Where to get NVRTC, for error messages.
pub const NVRTC_HINT: &str =
    "install NVRTC with `pip install nvidia-cuda-nvrtc` (or a CUDA toolkit), or set LILY_NVRTC to the path of libnvrtc.so";

/// Options of every compile (besides the architecture): C++17, no fast math (expf, sqrtf and
/// division stay IEEE-accurate, as the reference twins compute them).
const OPTIONS: &[&str] = &["-std=c++17", "--device-as-default-execution-space", "-default-device"];

/// Load NVRTC once per process; its version (major, minor).
pub fn load() -> Result<(i32, i32)> {
    static LOADED: OnceLock<std::result::Result<(i32, i32), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| load_once().map_err(|e| e.to_string()))
        .clone()
        .map_err(Error::Device)
}

fn candidates() -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(p) = std::env::var_os("LILY_NVRTC").filter(|p| !p.is_empty()) {
        v.push(PathBuf::from(p));
        return v;
    }
    for dir in [
        "/usr/local/cuda/lib64",
        "/usr/local/cuda/targets/x86_64-linux/lib",
        "/usr/lib/x86_64-linux-gnu",
    ] {
        for name in ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"] {
            v.push(PathBuf::from(dir).join(name));
        }
    }
    v
}

fn load_once() -> Result<(i32, i32)> {
    let explicit = std::env::var_os("LILY_NVRTC").is_some_and(|p| !p.is_empty());
    let mut tried = Vec::new();
    for path in candidates() {
        if !path.exists() {
            tried.push(path.display().to_string());
            continue;
        }
        // SAFETY: loading NVRTC runs its initializers only; the handle is leaked on purpose so
        // the library stays loaded for cudarc's lookups by soname.
        match unsafe {
            libloading::os::unix::Library::open(
                Some(&path),
                libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
            )
        } {
            Ok(lib) => {
                std::mem::forget(lib);
                preload_builtins(&path);
                break;
            }
            Err(e) if explicit => {
                return Err(Error::Device(format!(
                    "LILY_NVRTC={}: cannot load: {e}",
                    path.display()
                )));
            }
            Err(e) => tried.push(format!("{} ({e})", path.display())),
        }
    }
    // SAFETY: only tries to open the library by cudarc's candidate names (no symbol is used).
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Error::Device(format!(
            "NVRTC (the CUDA run-time compiler) was not found: {NVRTC_HINT} (looked in: {}, and the library search path)",
            tried.join(", ")
        )));
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is loaded (checked above); nvrtcVersion writes two ints.
    let rc = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if rc != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(Error::Device(format!("NVRTC: nvrtcVersion failed ({rc:?})")));
    }
    Ok((major, minor))
}

/// NVRTC opens `libnvrtc-builtins.so.<version>` by name when it compiles; a pip wheel's folder
/// is not on the loader's path, so the copy beside the library loaded is loaded first (by path,
/// kept), and NVRTC's lookup by soname then finds it.
fn preload_builtins(nvrtc: &std::path::Path) {
    let Some(dir) = nvrtc.parent() else { return };
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("libnvrtc-builtins.so") && !name.contains(".alt.") {
            // SAFETY: as for NVRTC itself: initializers only, kept loaded.
            if let Ok(lib) = unsafe {
                libloading::os::unix::Library::open(
                    Some(e.path()),
                    libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
                )
            } {
                std::mem::forget(lib);
            }
        }
    }
}

/// The compiled-kernel cache folder.
fn cache_dir() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("LILY_CUDA_CACHE").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("lily").join("cuda"))
}

/// One compiled source: its cubin, and the compiler's log (warnings) when it compiled now.
pub struct Compiled {
    pub file: &'static str,
    pub cubin: Vec<u8>,
    pub log: String,
}

/// Compile every source for `sm_<arch>` (e.g. 90), from the cache where possible
/// (`use_cache = false` always compiles: the CI check reads every log, which then also holds
/// ptxas's resource report: registers, stack frame and spills of each kernel).
pub fn compile_all(arch: u32, use_cache: bool) -> Result<Vec<Compiled>> {
    let version = load()?;
    let sources = kernels::Sources::load()?;
    let mut key = sources.hash();
    key.add(&arch.to_le_bytes());
    key.add(&version.0.to_le_bytes());
    key.add(&version.1.to_le_bytes());
    for o in OPTIONS {
        key.add(o.as_bytes());
    }
    let dir = cache_dir();
    let results: Vec<Result<Compiled>> = std::thread::scope(|s| {
        let handles: Vec<_> = sources
            .files
            .iter()
            .map(|(file, src)| {
                let (file, dir, headers) = (*file, dir.clone(), &sources.headers);
                s.spawn(move || -> Result<Compiled> {
                    let mut h: Fnv = key;
                    h.add(file.as_bytes());
                    let path = dir
                        .as_ref()
                        .map(|d| d.join(format!("{file}-sm{arch}-{:016x}.cubin", h.0)));
                    if use_cache {
                        if let Some(cubin) = path.as_ref().and_then(|p| std::fs::read(p).ok()) {
                            return Ok(Compiled {
                                file,
                                cubin,
                                log: String::new(),
                            });
                        }
                    }
                    let (cubin, log) = compile(file, src, headers, arch, !use_cache)?;
                    if let (Some(p), Some(d)) = (path, dir.as_ref()) {
                        // The cache is an optimisation: a read-only home still works.
                        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
                        if std::fs::create_dir_all(d).is_ok() && std::fs::write(&tmp, &cubin).is_ok() {
                            let _ = std::fs::rename(&tmp, &p);
                        }
                    }
                    Ok(Compiled { file, cubin, log })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Device("NVRTC: compiler thread panicked".into())))
            })
            .collect()
    });
    results.into_iter().collect()
}

/// Compile one source to a cubin for `sm_<arch>`; (cubin, log), the log with ptxas's resource
/// report when `report` (the same machine code either way).
fn compile(file: &str, src: &str, headers: &[(&str, String)], arch: u32, report: bool) -> Result<(Vec<u8>, String)> {
    use cudarc::nvrtc::sys::{self, nvrtcResult::NVRTC_SUCCESS};
    let cstr = |s: &str| CString::new(s).map_err(|_| Error::Device(format!("NVRTC: NUL in {file}")));
    let source = cstr(src)?;
    let name = cstr(file)?;
    let header_src: Vec<CString> = headers.iter().map(|(_, s)| cstr(s)).collect::<Result<_>>()?;
    let header_names: Vec<CString> = headers.iter().map(|(n, _)| cstr(n)).collect::<Result<_>>()?;
    let hp: Vec<*const c_char> = header_src.iter().map(|c| c.as_ptr()).collect();
    let hn: Vec<*const c_char> = header_names.iter().map(|c| c.as_ptr()).collect();
    let mut opts: Vec<CString> = vec![cstr(&format!("--gpu-architecture=sm_{arch}"))?];
    for o in OPTIONS {
        opts.push(cstr(o)?);
    }
    if report {
        opts.push(cstr("--ptxas-options=-v")?);
    }
    let op: Vec<*const c_char> = opts.iter().map(|c| c.as_ptr()).collect();
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer is a NUL-terminated string alive for the call; counts match.
    let rc = unsafe {
        sys::nvrtcCreateProgram(
            &mut prog,
            source.as_ptr(),
            name.as_ptr(),
            hp.len() as c_int,
            hp.as_ptr(),
            hn.as_ptr(),
        )
    };
    if rc != NVRTC_SUCCESS {
        return Err(Error::Device(format!(
            "NVRTC: cannot create a program for {file}: {rc:?}"
        )));
    }
    // SAFETY: `prog` is a valid program until destroyed below; the options outlive the call.
    let rc = unsafe { sys::nvrtcCompileProgram(prog, op.len() as c_int, op.as_ptr()) };
    let log = program_log(prog);
    let result = if rc != NVRTC_SUCCESS {
        Err(Error::Device(format!(
            "NVRTC: {file} does not compile for sm_{arch}:\n{log}"
        )))
    } else {
        let mut size = 0usize;
        // SAFETY: as above; the buffer has the size NVRTC reports.
        unsafe {
            if sys::nvrtcGetCUBINSize(prog, &mut size) != NVRTC_SUCCESS || size == 0 {
                Err(Error::Device(format!("NVRTC: no cubin for {file} (sm_{arch})")))
            } else {
                let mut cubin = vec![0u8; size];
                if sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char) != NVRTC_SUCCESS {
                    Err(Error::Device(format!("NVRTC: cannot read the cubin of {file}")))
                } else {
                    Ok((cubin, log))
                }
            }
        }
    };
    // SAFETY: destroyed once.
    unsafe { sys::nvrtcDestroyProgram(&mut prog) };
    result
}

fn program_log(prog: cudarc::nvrtc::sys::nvrtcProgram) -> String {
    use cudarc::nvrtc::sys;
    let mut size = 0usize;
    // SAFETY: a valid program; the buffer has the size NVRTC reports.
    unsafe {
        if sys::nvrtcGetProgramLogSize(prog, &mut size) != sys::nvrtcResult::NVRTC_SUCCESS || size <= 1 {
            return String::new();
        }
        let mut buf = vec![0u8; size];
        if sys::nvrtcGetProgramLog(prog, buf.as_mut_ptr() as *mut c_char) != sys::nvrtcResult::NVRTC_SUCCESS {
            return String::new();
        }
        String::from_utf8_lossy(&buf[..size - 1]).trim().to_string()
    }
}
