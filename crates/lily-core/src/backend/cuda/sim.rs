//! The simulated CUDA device: the same `.cu` sources, lowered (`lower`), compiled with clang-19
//! against the tools/cuda-sim prelude (`-DLILY_CUDA_SIM`) and linked with its runtime into one
//! shared library, whose kernels run on the CPU through `cuda_sim_launch` (blocks one after
//! another, the threads of a block as fibers, warp collectives and mma.sync emulated, shared
//! memory poisoned, every device buffer ending at a guard page: an overrun is an error naming the
//! kernel, the argument and the offset).
//!
//! The library is cached under `$LILY_CUDA_SIM_CACHE` (default `<tmp>/lily-cuda-sim`) by a hash
//! of the sources, the prelude, the compiler's version and the flags. `LILY_CUDA_SIM_CXX`
//! overrides `clang++-19`. `CUDA_SIM_SCHED=reverse` (or [`Sim::set_reverse`]) runs the threads
//! of each block in reverse order, which changes the result of a kernel missing a barrier.

use std::{
    ffi::{c_char, c_int, c_uint, c_void, CStr, CString},
    path::{Path, PathBuf},
    process::Command,
    sync::{
        atomic::{AtomicI32, Ordering},
        Arc, Mutex,
    },
};

use super::{
    executor::{Args, DevPtr, Executor, Launch},
    kernels,
};
use crate::{
    backend::simlib::Tool,
    error::{Error, Result},
};

const TOOL: Tool = Tool {
    name: "cuda-sim",
    device: "CUDA",
    cxx_var: "LILY_CUDA_SIM_CXX",
    cache_var: "LILY_CUDA_SIM_CACHE",
    cache_default: "lily-cuda-sim",
};

const PRELUDE: &str = include_str!("../../../../../tools/cuda-sim/include/cuda_sim.h");
const FLAGS: &[&str] = &["-x", "c++", "-std=c++20", "-O2", "-fPIC", "-DLILY_CUDA_SIM", "-w"];

type KernelFn = unsafe extern "C" fn(*mut *mut c_void);
type LaunchFn =
    unsafe extern "C" fn(KernelFn, *const c_uint, *const c_uint, c_uint, *mut *mut c_void, *const c_char) -> c_int;
type AllocFn = unsafe extern "C" fn(usize, *const c_char) -> *mut c_void;
type FreeFn = unsafe extern "C" fn(*mut c_void);
type ErrorFn = unsafe extern "C" fn() -> *const c_char;
type ScheduleFn = unsafe extern "C" fn(c_int);

pub struct SimFunction {
    f: KernelFn,
    name: CString,
}

// SAFETY: a function pointer into the library `Sim` keeps loaded for the process's lifetime.
unsafe impl Send for SimFunction {}
unsafe impl Sync for SimFunction {}

pub struct Sim {
    lib: Arc<libloading::Library>,
    launch: LaunchFn,
    alloc: AllocFn,
    free: FreeFn,
    error: ErrorFn,
    schedule: ScheduleFn,
    /// -1 as CUDA_SIM_SCHED says, 0 forward, 1 reverse.
    order: AtomicI32,
    /// Launches run one at a time (the runtime's launch state is per OS thread, its buffer
    /// registry is not).
    lock: Mutex<()>,
}

impl Sim {
    /// Build (or find in the cache) the kernels library and load it.
    pub fn new() -> Result<Sim> {
        Sim::from_library(&build_library(kernels::SOURCES)?)
    }

    /// A simulator running the kernels of a library made by [`build_library`].
    pub fn from_library(so: &Path) -> Result<Sim> {
        let lib = TOOL.load(so)?;
        // SAFETY: the symbol types are the C ABI at the end of cuda_sim.h.
        unsafe {
            let sym = |n: &[u8]| -> Result<*const c_void> {
                lib.get::<*const c_void>(n)
                    .map(|s| *s)
                    .map_err(|e| Error::Device(format!("cuda-sim: {}: {e}", String::from_utf8_lossy(n))))
            };
            Ok(Sim {
                launch: std::mem::transmute::<*const c_void, LaunchFn>(sym(b"cuda_sim_launch")?),
                alloc: std::mem::transmute::<*const c_void, AllocFn>(sym(b"cuda_sim_alloc")?),
                free: std::mem::transmute::<*const c_void, FreeFn>(sym(b"cuda_sim_free")?),
                error: std::mem::transmute::<*const c_void, ErrorFn>(sym(b"cuda_sim_last_error")?),
                schedule: std::mem::transmute::<*const c_void, ScheduleFn>(sym(b"cuda_sim_set_schedule")?),
                lib,
                order: AtomicI32::new(-1),
                lock: Mutex::new(()),
            })
        }
    }

    /// Run the threads of each block in reverse (`Some(true)`) or forward order, or as
    /// `CUDA_SIM_SCHED` says (`None`), for the launches from now on.
    pub fn set_reverse(&self, reverse: Option<bool>) {
        self.order.store(reverse.map_or(-1, |r| r as i32), Ordering::Relaxed);
    }
}

/// The simulator's compiler (`LILY_CUDA_SIM_CXX`, default `clang++-19`) and its `--version`
/// output, or why it cannot run (`Tool::compiler`).
pub fn compiler() -> std::result::Result<(String, Vec<u8>), String> {
    TOOL.compiler()
}

/// Compile `sources` (with the kernel headers) into one simulator library, cached by content.
/// Public for the simulator's own tests, which build planted-bug kernels through it.
pub fn build_library(sources: &[(&str, &str)]) -> Result<PathBuf> {
    // This simulator's builds run one at a time (`Tool::build`).
    static BUILD: Mutex<()> = Mutex::new(());
    let build = TOOL.build(&BUILD, FLAGS)?;
    let (cxx, cache, mut h) = (&build.cxx, &build.cache, build.key);
    h.add(PRELUDE.as_bytes());
    for (n, s) in kernels::HEADERS.iter().chain(sources) {
        h.add(n.as_bytes());
        h.add(s.as_bytes());
    }
    let so = cache.join(format!("kernels-{:016x}.so", h.0));
    if so.exists() {
        return Ok(so);
    }
    let dir = cache.join(format!("build-{:016x}-{}", h.0, std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| dev_err("cannot create", &dir, e))?;
    std::fs::write(dir.join("cuda_sim.h"), PRELUDE).map_err(|e| dev_err("cannot write", &dir, e))?;
    for (n, s) in kernels::HEADERS {
        std::fs::write(dir.join(n), s).map_err(|e| dev_err("cannot write", &dir, e))?;
    }
    std::fs::write(dir.join("runtime.cpp"), "#include \"cuda_sim.h\"\n")
        .map_err(|e| dev_err("cannot write", &dir, e))?;
    let mut units = vec![("runtime.cpp".to_string(), vec!["-DCUDA_SIM_RUNTIME".to_string()])];
    for (n, s) in sources {
        let cpp = format!("{n}.cpp");
        std::fs::write(dir.join(&cpp), lower(n, s)).map_err(|e| dev_err("cannot write", &dir, e))?;
        units.push((cpp, vec!["-include".into(), "cuda_sim.h".into()]));
    }
    // Two compilers at a time (CI machines have two cores).
    let results: Vec<Result<PathBuf>> = std::thread::scope(|s| {
        let chunks: Vec<Vec<&(String, Vec<String>)>> =
            (0..2).map(|k| units.iter().skip(k).step_by(2).collect()).collect();
        let handles: Vec<_> = chunks
            .into_iter()
            .map(|chunk| {
                let (cxx, dir) = (&cxx, &dir);
                s.spawn(move || -> Vec<Result<PathBuf>> {
                    chunk
                        .into_iter()
                        .map(|(src, extra)| compile(cxx, dir, src, extra))
                        .collect()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| {
                h.join()
                    .unwrap_or_else(|_| vec![Err(Error::Device("cuda-sim: compiler thread panicked".into()))])
            })
            .collect()
    });
    let objs = results.into_iter().collect::<Result<Vec<_>>>()?;
    let tmp = so.with_extension(format!("tmp{}.so", std::process::id()));
    let mut link = Command::new(cxx);
    link.arg("-shared").args(&objs).arg("-o").arg(&tmp);
    TOOL.compile(cxx, "link failed", &mut link)?;
    std::fs::rename(&tmp, &so).map_err(|e| dev_err("cannot write", &so, e))?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(so)
}

fn compile(cxx: &str, dir: &Path, src: &str, extra: &[String]) -> Result<PathBuf> {
    let obj = dir.join(format!("{src}.o"));
    let mut cmd = Command::new(cxx);
    cmd.args(FLAGS)
        .arg("-I")
        .arg(dir)
        .args(extra)
        .arg("-c")
        .arg(dir.join(src))
        .arg("-o")
        .arg(&obj);
    TOOL.compile(cxx, &format!("{src} does not compile"), &mut cmd)?;
    Ok(obj)
}

fn dev_err(what: &str, path: &Path, e: impl std::fmt::Display) -> Error {
    TOOL.io_err(what, path, e)
}

/// The textual rewrites C++ macros cannot express: kernel-scope `__shared__ T name[N]...;`
/// becomes `CUDA_SIM_SHARED(T, name, [N]...);`, `extern __shared__ T name[];` becomes
/// `CUDA_SIM_EXTERN_SHARED(T, name);` (an `__align__(n)` is dropped: the simulator aligns every
/// shared array to 16 bytes), and every kernel written out as `extern "C" __global__ ... name(`
/// at the start of a line (not inside a macro) gets `CUDA_SIM_EXPORT(name)` at the end of the
/// file. Line numbers are kept.
pub fn lower(file: &str, src: &str) -> String {
    let mut out = format!("#line 1 \"{file}\"\n");
    let mut kernels = Vec::new();
    let mut continued = false;
    for line in src.split_inclusive('\n') {
        let in_macro = continued;
        continued = line.trim_end().ends_with('\\');
        let body = line.trim_start();
        let indent = &line[..line.len() - body.len()];
        let shared = body
            .strip_prefix("extern __shared__ ")
            .map(|r| (true, r))
            .or_else(|| body.strip_prefix("__shared__ ").map(|r| (false, r)));
        if let Some((ext, rest)) = shared {
            if let Some(decl) = shared_decl(rest) {
                out.push_str(indent);
                if ext {
                    out.push_str(&format!("CUDA_SIM_EXTERN_SHARED({}, {});\n", decl.0, decl.1));
                } else {
                    out.push_str(&format!("CUDA_SIM_SHARED({}, {}, {});\n", decl.0, decl.1, decl.2));
                }
                continue;
            }
        }
        if !in_macro {
            if let Some(rest) = body.strip_prefix("extern \"C\" __global__ ") {
                if let Some(name) = kernel_name(rest) {
                    kernels.push(name);
                }
            }
        }
        out.push_str(line);
    }
    out.push('\n');
    for k in kernels {
        out.push_str(&format!("CUDA_SIM_EXPORT({k})\n"));
    }
    out
}

/// `[__align__(n)] T name[dims]...;` -> (T, name, "[dims]...").
fn shared_decl(rest: &str) -> Option<(String, String, String)> {
    let mut r = rest.trim();
    if let Some(a) = r.strip_prefix("__align__(") {
        r = a[a.find(')')? + 1..].trim_start();
    }
    let r = r.strip_suffix(';')?.trim_end();
    let br = r.find('[')?;
    let head = r[..br].trim_end();
    let split = head.rfind(|c: char| !(c.is_alphanumeric() || c == '_'))?;
    let (ty, name) = (head[..=split].trim(), head[split + 1..].trim());
    if ty.is_empty() || name.is_empty() {
        return None;
    }
    Some((ty.to_string(), name.to_string(), r[br..].to_string()))
}

/// The kernel name in `void [__launch_bounds__(..)] name(`.
fn kernel_name(rest: &str) -> Option<String> {
    let mut r = rest.trim_start().strip_prefix("void")?.trim_start();
    if let Some(a) = r.strip_prefix("__launch_bounds__(") {
        r = a[a.find(')')? + 1..].trim_start();
    }
    let end = r.find('(')?;
    let name = r[..end].trim();
    (!name.is_empty() && name.chars().all(|c| c.is_alphanumeric() || c == '_')).then(|| name.to_string())
}

impl Sim {
    fn last_error(&self) -> String {
        // SAFETY: the runtime returns a NUL-terminated thread-local buffer.
        unsafe { CStr::from_ptr((self.error)()) }.to_string_lossy().into_owned()
    }
}

impl Executor for Sim {
    const NAME: &'static str = TOOL.name;
    type Function = SimFunction;
    type Graph = ();

    fn describe(&self) -> String {
        "CUDA simulator (clang-19, tools/cuda-sim; bounds checking on)".into()
    }

    fn alloc(&self, bytes: usize, label: &str) -> Result<DevPtr> {
        let label = CString::new(label.replace('\0', " ")).unwrap_or_default();
        // SAFETY: the runtime's allocator; the label is copied.
        let p = unsafe { (self.alloc)(bytes.max(1), label.as_ptr()) };
        if p.is_null() {
            return Err(Error::Device(format!(
                "cuda-sim: out of memory allocating {bytes} bytes"
            )));
        }
        Ok(p as DevPtr)
    }

    fn free(&self, p: DevPtr) {
        let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: `p` came from `alloc` and is freed once (its `Alloc` owner drops once).
        unsafe { (self.free)(p as *mut c_void) }
    }

    fn write(&self, dst: DevPtr, data: &[u8]) -> Result<()> {
        // SAFETY: the backend writes inside its own allocations (checked by its callers).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst as *mut u8, data.len()) };
        Ok(())
    }

    fn read(&self, src: DevPtr, out: &mut [u8]) -> Result<()> {
        // SAFETY: as `write`.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn zero(&self, dst: DevPtr, bytes: usize) -> Result<()> {
        // SAFETY: as `write`.
        unsafe { std::ptr::write_bytes(dst as *mut u8, 0, bytes) };
        Ok(())
    }

    fn copy(&self, src: DevPtr, dst: DevPtr, bytes: usize) -> Result<()> {
        // SAFETY: as `write`; distinct buffers.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }

    fn function(&self, name: &str) -> Result<SimFunction> {
        let sym = format!("cuda_sim_kernel_{name}");
        // SAFETY: exported by CUDA_SIM_EXPORT with this signature.
        let f = unsafe { self.lib.get::<KernelFn>(sym.as_bytes()) }
            .map_err(|_| Error::Device(format!("cuda-sim: no kernel named {name:?} in the compiled sources")))?;
        Ok(SimFunction {
            f: *f,
            name: CString::new(name).unwrap_or_default(),
        })
    }

    fn launch(&self, f: &SimFunction, _name: &str, shape: Launch, args: &mut Args) -> Result<()> {
        let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut ptrs = args.pointers();
        // SAFETY: the pointers address the argument values in `args`, in parameter order and
        // NULL-terminated, as the kernel's CUDA_SIM_EXPORT unpacks them.
        let rc = unsafe {
            (self.schedule)(self.order.load(Ordering::Relaxed));
            (self.launch)(
                f.f,
                shape.grid.as_ptr(),
                shape.block.as_ptr(),
                shape.shared,
                ptrs.as_mut_ptr(),
                f.name.as_ptr(),
            )
        };
        if rc != 0 {
            return Err(Error::Device(format!("cuda-sim: {}", self.last_error())));
        }
        Ok(())
    }

    fn sync(&self) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lowering() {
        let src = "__global__ x;\n  __shared__ float partial[32];\n  __shared__ __align__(16) ushort xs[64 * 72];\n  extern __shared__ float dyn[];\nextern \"C\" __global__ void __launch_bounds__(256) rms_norm(int a) {\n#define M(s) \\\nextern \"C\" __global__ void hidden_##s(int a) {}\n";
        let l = lower("f.cu", src);
        assert!(l.contains("  CUDA_SIM_SHARED(float, partial, [32]);\n"), "{l}");
        assert!(l.contains("CUDA_SIM_SHARED(ushort, xs, [64 * 72]);"), "{l}");
        assert!(l.contains("CUDA_SIM_EXTERN_SHARED(float, dyn);"), "{l}");
        assert!(l.contains("CUDA_SIM_EXPORT(rms_norm)"), "{l}");
        assert!(!l.contains("CUDA_SIM_EXPORT(hidden"), "{l}");
        assert_eq!(l.lines().count(), src.lines().count() + 3);
    }
}
