//! The simulated Metal device: the same `.metal` sources, compiled with clang-19 against the
//! tools/metal-sim prelude (`-DMTL_EXEC`) into one shared library per file, and dispatched on
//! the CPU through its `mtl_dispatch` (the threads of a threadgroup as fibers, simd collectives
//! emulated at 32 lanes, threadgroup memory poisoned, every buffer bounds-checked behind a guard
//! page; the threadgroups of a dispatch shared out over `MTL_THREADS` OS threads, default the
//! CPUs online).
//!
//! Libraries are cached under `$LILY_METAL_SIM_CACHE` (default: `<tmp>/lily-metal-sim`) by a
//! hash of the sources, the prelude and the flags. `LILY_METAL_SIM_CXX` overrides `clang++-19`;
//! `LILY_METAL_SIM_BOUNDS=0` turns the guard-page copies off (faster, no overrun detection);
//! `MTL_SCHED=reverse` runs the threads of a threadgroup in reverse order (`Sim::set_reverse`
//! sets it for one device). The simulated device reports the GPU family it is built with
//! (`Sim::with_family`; `Sim::new`: `LILY_METAL_FAMILY`, else the newest), which picks the kernel
//! variants the backend dispatches; the simulator runs every variant alike.
//!
//! Like the device, it wraps weight tensors of the mapped checkpoint in place where the device
//! would (`executor::wrappable`, with 4 KiB pages) and copies the others, so the copied bytes it
//! counts are a Mac's. Test hooks: `LILY_METAL_SIM_WORKING_SET=BYTES` makes it report a GPU
//! working set of that size (the memory check at load); `LILY_METAL_SIM_FAIL_COMMAND=N` (or
//! [`Sim::fail_command`]) makes the Nth command stream committed fail after running half its
//! dispatches, as a GPU error leaves state half-updated.
//!
//! `LILY_METAL_SIM_TRAFFIC=FILE` counts the device-memory bytes every dispatch reads and writes
//! (see `traffic.rs`: page protection, first touches) and appends one line per dispatch to FILE:
//! `stream label<TAB>kernel<TAB>bytes read<TAB>bytes written`. Counting turns bounds checking off
//! (its guard copies would touch every bound byte) and is never on unless asked for.

use std::{
    ffi::{c_int, c_ulong, c_void},
    path::{Path, PathBuf},
    process::Command,
    ptr::NonNull,
    sync::{
        atomic::{AtomicI32, AtomicU64, Ordering},
        Arc, Mutex, OnceLock,
    },
};

use super::{
    executor::{wrappable, Arg, Executor, GpuFamily, Grid, ParamBytes, Placed, StreamLabel},
    kernels, traffic,
};
use crate::{
    backend::simlib::{Fnv, Tool},
    error::{Error, Result},
    safetensors::Bytes,
};

const TOOL: Tool = Tool {
    name: "metal-sim",
    device: "Metal",
    cxx_var: "LILY_METAL_SIM_CXX",
    cache_var: "LILY_METAL_SIM_CACHE",
    cache_default: "lily-metal-sim",
};

macro_rules! prelude {
    ($file:literal) => {
        (
            $file,
            include_str!(concat!("../../../../../tools/metal-sim/include/", $file)),
        )
    };
}

/// The stand-in for `<metal_stdlib>` and friends.
const PRELUDE: &[(&str, &str)] = &[
    prelude!("mtl_prelude.h"),
    prelude!("metal_atomic"),
    prelude!("metal_common"),
    prelude!("metal_compute"),
    prelude!("metal_geometric"),
    prelude!("metal_integer"),
    prelude!("metal_math"),
    prelude!("metal_relational"),
    prelude!("metal_simdgroup"),
    prelude!("metal_simdgroup_matrix"),
    prelude!("metal_stdlib"),
];

/// `-DMTL_NO_BFLOAT`: the shaders as Metal Shading Language 3.0, which the device compiles them as
/// (no `bfloat` type).
const FLAGS: &[&str] = &[
    "-x",
    "c++",
    "-std=c++20",
    "-O2",
    "-fPIC",
    "-shared",
    "-DMTL_EXEC",
    "-DMTL_NO_BFLOAT",
    "-w",
];

type KernelGetter = unsafe extern "C" fn() -> *const c_void;
type DispatchFn = unsafe extern "C" fn(
    *const c_void,
    *const u32,
    *const u32,
    *const u32,
    *mut *mut c_void,
    *const c_ulong,
    c_int,
    *const c_ulong,
    c_int,
) -> c_int;
type ScheduleFn = unsafe extern "C" fn(c_int);

/// Host memory standing in for a shared-storage `MTLBuffer`: an allocation of its own
/// (page-aligned, whole pages, like a Metal buffer), or whole pages of a mapped checkpoint.
pub struct SimAlloc {
    ptr: NonNull<u8>,
    len: usize,
    /// The mapping wrapped in place (`None`: an allocation of `len` bytes, page-aligned).
    mapped: Option<Bytes>,
}

/// Page size of the simulated buffers and of the region rounding when weights are wrapped.
const PAGE: usize = 4096;

// SAFETY: a plain heap allocation or a read-only mapping; access is ordered by the command
// stream (one dispatch at a time).
unsafe impl Send for SimAlloc {}
unsafe impl Sync for SimAlloc {}

impl SimAlloc {
    fn layout(len: usize) -> std::alloc::Layout {
        // Whole pages: a buffer never shares a page with another allocation.
        std::alloc::Layout::from_size_align(len.max(16).next_multiple_of(PAGE), PAGE).expect("a page-aligned layout")
    }

    /// Bytes of the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for SimAlloc {
    fn drop(&mut self) {
        if self.mapped.is_none() {
            // SAFETY: allocated in `new_buffer` with this layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
        }
    }
}

pub struct SimPipeline {
    kernel: *const c_void,
    dispatch: DispatchFn,
    schedule: ScheduleFn,
    _lib: Arc<libloading::Library>,
}

// SAFETY: function pointers into a library kept loaded by `_lib`.
unsafe impl Send for SimPipeline {}
unsafe impl Sync for SimPipeline {}

/// One recorded dispatch, run at `commit_wait`.
pub struct Recorded {
    name: String,
    kernel: *const c_void,
    dispatch: DispatchFn,
    schedule: ScheduleFn,
    args: Vec<RecArg>,
    grid: Grid,
    tg_mem: Vec<usize>,
}

// SAFETY: as SimPipeline; the buffers are owned through Arc.
unsafe impl Send for Recorded {}

pub enum RecArg {
    Bytes(ParamBytes),
    Buf(Arc<SimAlloc>, usize, usize),
}

/// A recorded command stream and its label (named in error messages), run at `commit`.
pub struct SimEncoder {
    label: StreamLabel,
    dispatches: Vec<Recorded>,
    /// Buffers made resident (`use_resources`) and, per dispatch, how many were then: what a
    /// dispatch reaches through addresses, protected with its bindings when traffic is counted.
    resident: Vec<Arc<SimAlloc>>,
    resident_at: Vec<usize>,
}

/// A committed stream: it ran at `commit`; its error, if any, is reported by `wait`.
pub struct SimPending(Option<Error>);

pub struct Sim {
    libs: Vec<Arc<libloading::Library>>,
    bounds_check: bool,
    family: GpuFamily,
    /// The labels of the command streams committed so far (the latest 256), for tests.
    committed: Mutex<Vec<StreamLabel>>,
    /// Fiber order of the dispatches: -1 as `MTL_SCHED` says, 0 forward, 1 reverse.
    schedule: AtomicI32,
    /// `LILY_METAL_SIM_WORKING_SET`: the GPU working set reported (None: no limit).
    working_set: Option<u64>,
    /// Command streams committed so far, and the number of the one to fail (0: none).
    commits: AtomicU64,
    fail_at: AtomicU64,
    /// `LILY_METAL_SIM_TRAFFIC`: the file the bytes per dispatch are appended to.
    traffic: Option<PathBuf>,
}

impl Sim {
    /// Compile (or find in the cache) every shader and load it. The device reports GPU family
    /// `LILY_METAL_FAMILY` if set, else the newest ([`GpuFamily::NEWEST`]).
    pub fn new() -> Result<Sim> {
        let family = GpuFamily::from_env()?.unwrap_or(GpuFamily::NEWEST);
        Self::with_family(family)
    }

    /// [`Sim::new`] reporting GPU family `family` (whatever `LILY_METAL_FAMILY` says).
    pub fn with_family(family: GpuFamily) -> Result<Sim> {
        // This simulator's builds run one at a time (`Tool::build`).
        static BUILD: Mutex<()> = Mutex::new(());
        let b = TOOL.build(&BUILD, FLAGS)?;
        let (cxx, cache, mut common) = (&b.cxx, &b.cache, b.key);
        for (n, s) in PRELUDE
            .iter()
            .chain(kernels::SOURCES.iter().filter(|(n, _)| n.ends_with(".h")))
        {
            common.add(n.as_bytes());
            common.add(s.as_bytes());
        }
        let src_dir = cache.join(format!("src-{:016x}", common.0));
        write_tree(&src_dir, &common)?;
        let files: Vec<(&str, &str)> = kernels::metal_files().collect();
        let results: Vec<Result<PathBuf>> = std::thread::scope(|s| {
            let handles: Vec<_> = files
                .iter()
                .map(|(name, src)| {
                    let (cxx, src_dir, cache, common) = (&cxx, &src_dir, &cache, &common);
                    s.spawn(move || build(cxx, src_dir, cache, common, name, src))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Error::Device("shader build panicked".into())))
                })
                .collect()
        });
        let mut libs = Vec::new();
        for r in results {
            let so = r?;
            libs.push(TOOL.load(&so)?);
        }
        let traffic = std::env::var_os("LILY_METAL_SIM_TRAFFIC")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
        let bounds_check = traffic.is_none() && std::env::var("LILY_METAL_SIM_BOUNDS").map_or(true, |v| v != "0");
        let working_set = super::sim_working_set()?;
        let fail_at = super::env_number("LILY_METAL_SIM_FAIL_COMMAND")?.unwrap_or(0);
        Ok(Sim {
            libs,
            bounds_check,
            family,
            committed: Mutex::new(Vec::new()),
            schedule: AtomicI32::new(-1),
            working_set,
            commits: AtomicU64::new(0),
            fail_at: AtomicU64::new(fail_at),
            traffic,
        })
    }

    /// Make the `n`th command stream committed from now (1: the next) fail after running the
    /// first half of its dispatches: what a GPU error does to the state it was updating.
    pub fn fail_command(&self, n: u64) {
        let done = self.commits.load(Ordering::Relaxed);
        self.fail_at.store(done + n, Ordering::Relaxed);
    }

    /// Run the threads of each threadgroup in reverse (`Some(true)`) or forward order, or as
    /// `MTL_SCHED` says (`None`, the default), for the dispatches committed from now on: a
    /// kernel that depends on the order in which its threads run (a missing barrier) gives a
    /// different result reversed.
    pub fn set_reverse(&self, reverse: Option<bool>) {
        let mode = reverse.map_or(-1, |r| r as i32);
        self.schedule.store(mode, Ordering::Relaxed);
    }

    /// The labels of the command streams committed since the last call (at most the latest
    /// 256), oldest first: what the device would label its command buffers with.
    pub fn take_committed_labels(&self) -> Vec<StreamLabel> {
        std::mem::take(&mut *self.committed.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// The simulator's compiler (`LILY_METAL_SIM_CXX`, default `clang++-19`) and its `--version`
/// output, or why it cannot run (`Tool::compiler`).
pub fn compiler() -> std::result::Result<(String, Vec<u8>), String> {
    TOOL.compiler()
}

fn dev_err(what: &str, path: &Path, e: impl std::fmt::Display) -> Error {
    TOOL.io_err(what, path, e)
}

/// Write `content` to `path` through a temporary name (concurrent builders never see half a file).
fn write_atomic(path: &Path, content: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, content).map_err(|e| dev_err("cannot write", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| dev_err("cannot write", path, e))
}

/// The prelude and the shared headers, once per content hash.
fn write_tree(dir: &Path, _key: &Fnv) -> Result<()> {
    static LOCK: OnceLock<Mutex<()>> = OnceLock::new();
    let _g = LOCK
        .get_or_init(|| Mutex::new(()))
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if dir.join("ok").exists() {
        return Ok(());
    }
    std::fs::create_dir_all(dir).map_err(|e| dev_err("cannot create", dir, e))?;
    for (n, s) in PRELUDE
        .iter()
        .chain(kernels::SOURCES.iter().filter(|(n, _)| n.ends_with(".h")))
    {
        write_atomic(&dir.join(n), s.as_bytes())?;
    }
    write_atomic(&dir.join("ok"), b"")
}

fn build(cxx: &str, src_dir: &Path, cache: &Path, common: &Fnv, name: &str, src: &str) -> Result<PathBuf> {
    let mut h = *common;
    h.add(name.as_bytes());
    h.add(src.as_bytes());
    let stem = name.trim_end_matches(".metal");
    let so = cache.join(format!("{stem}-{:016x}.so", h.0));
    if so.exists() {
        return Ok(so);
    }
    let cpp = src_dir.join(format!("{stem}-{:016x}.cpp", h.0));
    write_atomic(&cpp, lower(name, src).as_bytes())?;
    let tmp = so.with_extension(format!("tmp{}.so", std::process::id()));
    let mut cmd = Command::new(cxx);
    cmd.args(FLAGS).arg("-I").arg(src_dir).arg(&cpp).arg("-o").arg(&tmp);
    TOOL.compile(cxx, &format!("{name} does not compile"), &mut cmd)?;
    std::fs::rename(&tmp, &so).map_err(|e| dev_err("cannot write", &so, e))?;
    Ok(so)
}

/// The textual rewrites of tools/metal-sim/mtl_lower.py (kept in step with it): kernel-scope
/// `threadgroup` variables become `MTL_TG_VAR`, `[[threadgroup(n)]]` arguments are renamed,
/// `[[kernel]]` becomes `kernel`, and every non-template `kernel void name` is exported.
pub fn lower(file: &str, src: &str) -> String {
    let src = src
        .replace("[[threadgroup(", "[[mtl_threadgroup_arg(")
        .replace("[[kernel]]", "kernel");
    let mut out = format!("#line 1 \"{file}\"\n");
    let mut kernels = Vec::new();
    for line in src.split_inclusive('\n') {
        let body = line.trim_start();
        let indent = &line[..line.len() - body.len()];
        if let Some(rest) = body.strip_prefix("threadgroup") {
            if rest.starts_with(|c: char| c.is_whitespace()) && is_variable_decl(rest) {
                out.push_str(indent);
                out.push_str("MTL_TG_VAR");
                out.push_str(rest);
                continue;
            }
        }
        let words: Vec<&str> = body
            .split(|c: char| c.is_whitespace() || c == '(')
            .filter(|w| !w.is_empty())
            .collect();
        if words.len() >= 3 && words[0] == "kernel" && words[1] == "void" {
            kernels.push(words[2].to_string());
        }
        out.push_str(line);
    }
    out.push('\n');
    for k in kernels {
        out.push_str(&format!("MTL_EXPORT({k})\n"));
    }
    out
}

/// `rest` (after `threadgroup`) reaches `;` with no `*&(){}` outside `[...]`.
fn is_variable_decl(rest: &str) -> bool {
    let mut depth = 0;
    for c in rest.chars() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ';' => return true,
            '*' | '&' | '(' | ')' | '{' | '}' if depth == 0 => return false,
            _ => {}
        }
    }
    false
}

impl Executor for Sim {
    const NAME: &'static str = TOOL.name;
    type Buffer = Arc<SimAlloc>;
    type Pipeline = SimPipeline;
    type Encoder = SimEncoder;
    type Pending = SimPending;

    fn describe(&self) -> String {
        format!(
            "Metal simulator (clang-19, tools/metal-sim; GPU family {}; bounds checking {}{})",
            self.family,
            if self.bounds_check { "on" } else { "off" },
            if self.traffic.is_some() {
                "; counting traffic"
            } else {
                ""
            }
        )
    }

    fn family(&self) -> GpuFamily {
        self.family
    }

    fn working_set(&self) -> Option<u64> {
        self.working_set
    }

    fn new_buffer(&self, bytes: usize) -> Result<Arc<SimAlloc>> {
        if bytes > isize::MAX as usize - PAGE {
            return Err(Error::Device(format!(
                "metal-sim: a buffer of {bytes} bytes is too large"
            )));
        }
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(SimAlloc::layout(bytes)) })
            .ok_or_else(|| Error::Device(format!("metal-sim: out of memory allocating {bytes} bytes")))?;
        Ok(Arc::new(SimAlloc {
            ptr,
            len: bytes.max(16),
            mapped: None,
        }))
    }

    fn weight_buffer(&self, data: &Bytes) -> Result<Placed<Arc<SimAlloc>>> {
        let ptr = data.as_slice().as_ptr() as usize;
        let Some((start, len, offset)) = wrappable(ptr, data.len(), PAGE, usize::MAX) else {
            return Ok(Placed {
                buf: self.new_buffer_with(data.as_slice())?,
                offset: 0,
                copied: true,
            });
        };
        let buf = Arc::new(SimAlloc {
            // The region's start lies in the mapping's first page or later (wrappable).
            ptr: NonNull::new(start as *mut u8).expect("a mapped address"),
            len,
            mapped: Some(data.clone()),
        });
        Ok(Placed {
            buf,
            offset,
            copied: false,
        })
    }

    fn contents(&self, b: &Arc<SimAlloc>) -> *mut u8 {
        b.ptr.as_ptr()
    }

    fn gpu_address(&self, b: &Arc<SimAlloc>) -> u64 {
        b.ptr.as_ptr() as u64
    }

    fn pipeline(&self, name: &str) -> Result<SimPipeline> {
        let sym = format!("mtl_kernel_{name}");
        for lib in &self.libs {
            // SAFETY: the symbol types are those of the prelude's C ABI (mtl_prelude.h).
            unsafe {
                if let Ok(get) = lib.get::<KernelGetter>(sym.as_bytes()) {
                    let dispatch = *lib
                        .get::<DispatchFn>(b"mtl_dispatch")
                        .map_err(|e| Error::Device(format!("metal-sim: no mtl_dispatch: {e}")))?;
                    let schedule = *lib
                        .get::<ScheduleFn>(b"mtl_set_schedule")
                        .map_err(|e| Error::Device(format!("metal-sim: no mtl_set_schedule: {e}")))?;
                    return Ok(SimPipeline {
                        kernel: get(),
                        dispatch,
                        schedule,
                        _lib: lib.clone(),
                    });
                }
            }
        }
        Err(Error::Device(format!(
            "metal-sim: no kernel named {name:?} in the compiled shaders"
        )))
    }

    fn encoder(&self, label: StreamLabel) -> Result<SimEncoder> {
        Ok(SimEncoder {
            label,
            dispatches: Vec::new(),
            resident: Vec::new(),
            resident_at: Vec::new(),
        })
    }

    fn use_resources(&self, enc: &mut SimEncoder, bufs: &[Arc<SimAlloc>]) {
        if self.traffic.is_some() {
            enc.resident.extend(bufs.iter().cloned());
        }
    }

    fn dispatch(
        &self,
        enc: &mut SimEncoder,
        name: &str,
        p: &SimPipeline,
        args: &[Arg<'_, Arc<SimAlloc>>],
        grid: Grid,
        tg_mem: &[usize],
    ) {
        let args = args
            .iter()
            .map(|a| match a {
                Arg::Bytes(b) => RecArg::Bytes(*b),
                Arg::Buf(b, off, len) => RecArg::Buf((*b).clone(), *off, *len),
            })
            .collect();
        enc.dispatches.push(Recorded {
            name: name.to_string(),
            kernel: p.kernel,
            dispatch: p.dispatch,
            schedule: p.schedule,
            args,
            grid,
            tg_mem: tg_mem.to_vec(),
        });
        enc.resident_at.push(enc.resident.len());
    }

    fn commit(&self, enc: SimEncoder) -> Result<SimPending> {
        Ok(SimPending(self.run(enc).err()))
    }

    fn wait(&self, done: SimPending) -> Result<()> {
        match done.0 {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Sim {
    /// Run a committed stream's dispatches in order.
    fn run(&self, enc: SimEncoder) -> Result<()> {
        let label = enc.label;
        {
            let mut c = self.committed.lock().unwrap_or_else(|e| e.into_inner());
            if c.len() == 256 {
                c.remove(0);
            }
            c.push(label);
        }
        let number = self.commits.fetch_add(1, Ordering::Relaxed) + 1;
        let fail = number == self.fail_at.load(Ordering::Relaxed);
        let run = if fail {
            enc.dispatches.len() / 2
        } else {
            enc.dispatches.len()
        };
        let mut counted = String::new();
        for (i, mut r) in enc.dispatches.into_iter().take(run).enumerate() {
            let mut ptrs: Vec<*mut c_void> = Vec::with_capacity(r.args.len());
            let mut sizes: Vec<c_ulong> = Vec::with_capacity(r.args.len());
            for a in r.args.iter_mut() {
                match a {
                    RecArg::Bytes(b) => {
                        sizes.push(b.as_slice().len() as c_ulong);
                        // Mutable: with bounds checking, mtl_dispatch copies every binding back.
                        ptrs.push(b.as_mut_ptr() as *mut c_void);
                    }
                    RecArg::Buf(b, off, len) => {
                        if *off + *len > b.len {
                            return Err(Error::Device(format!(
                                "metal-sim: {} ({label}): binding {} bytes at offset {} of a {}-byte buffer",
                                r.name, len, off, b.len
                            )));
                        }
                        // SAFETY: in bounds, checked just above.
                        ptrs.push(unsafe { b.ptr.as_ptr().add(*off) } as *mut c_void);
                        sizes.push(*len as c_ulong);
                    }
                }
            }
            let tg_bytes: Vec<c_ulong> = r.tg_mem.iter().map(|&b| b as c_ulong).collect();
            let (count, size, threads) = match r.grid {
                Grid::Groups { count, size } => (count, size, None),
                Grid::Threads { threads, size } => ([0; 3], size, Some(threads)),
            };
            let empty = match r.grid {
                Grid::Groups { count, .. } => count.contains(&0),
                Grid::Threads { threads, .. } => threads.contains(&0),
            };
            if empty {
                continue; // an empty grid runs nothing, as on the device
            }
            // SAFETY: pointers and sizes describe live buffers (held by `r`) in slot order, the
            // kernel pointer comes from the library that exports `dispatch` and `schedule`
            // (which only sets a thread-local of that library for this thread's dispatches).
            let mut go = || unsafe {
                (r.schedule)(self.schedule.load(Ordering::Relaxed));
                (r.dispatch)(
                    r.kernel,
                    count.as_ptr(),
                    size.as_ptr(),
                    threads.as_ref().map_or(std::ptr::null(), |t| t.as_ptr()),
                    ptrs.as_mut_ptr(),
                    if self.bounds_check {
                        sizes.as_ptr()
                    } else {
                        std::ptr::null()
                    },
                    ptrs.len() as c_int,
                    tg_bytes.as_ptr(),
                    tg_bytes.len() as c_int,
                )
            };
            let rc = if self.traffic.is_some() {
                let ranges = traffic_ranges(&r.args, &enc.resident[..enc.resident_at[i]]);
                let (rc, bytes) = traffic::count(&ranges, go)?;
                counted.push_str(&format!("{label}\t{}\t{}\t{}\n", r.name, bytes.read, bytes.written));
                rc
            } else {
                go()
            };
            if rc != 0 {
                return Err(Error::Device(format!(
                    "metal-sim: kernel {} failed in {label} (mtl_dispatch returned {rc})",
                    r.name
                )));
            }
        }
        if let Some(path) = &self.traffic {
            use std::io::Write;
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .and_then(|mut f| f.write_all(counted.as_bytes()))
                .map_err(|e| dev_err("cannot append traffic to", path, e))?;
        }
        if fail {
            return Err(Error::Device(format!(
                "metal-sim: command stream {number} ({label}) failed after {run} of its dispatches (injected: LILY_METAL_SIM_FAIL_COMMAND / Sim::fail_command)"
            )));
        }
        Ok(())
    }
}

/// The byte ranges a dispatch may touch: its buffer bindings and the buffers resident for it.
fn traffic_ranges(args: &[RecArg], resident: &[Arc<SimAlloc>]) -> Vec<traffic::Range> {
    let bound = args.iter().filter_map(|a| match a {
        RecArg::Buf(b, off, len) => Some((b, *off, *len)),
        RecArg::Bytes(_) => None,
    });
    bound
        .chain(resident.iter().map(|b| (b, 0, b.len)))
        .map(|(b, off, len)| traffic::Range {
            start: b.ptr.as_ptr() as usize + off,
            len,
            writable: b.mapped.is_none(),
        })
        .collect()
}
