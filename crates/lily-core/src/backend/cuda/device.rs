//! The real CUDA device: the [`Executor`] that `Cuda<Device>` drives, on the driver API through
//! cudarc's raw bindings, loaded dynamically (a package built without CUDA still imports; where
//! no driver or no NVRTC exists, `Device::new` returns an `Error::Device` that says what is
//! missing; cudarc panics on a missing library or symbol, so every load is checked first and the
//! whole construction runs under `catch_unwind`).
//!
//! - Device: ordinal `LILY_CUDA_DEVICE` (default 0), its primary context, made current on every
//!   thread that calls in (the engine may be driven from any Python thread); one stream.
//! - Kernels: every `.cu` compiled by NVRTC to a cubin for the device's compute capability
//!   (`nvrtc.rs`: why not PTX, where NVRTC is found, the disk cache), loaded as modules.
//! - Memory: `cuMemAlloc` (plain device memory), zeroed; host copies on the stream, waited for.
//! - Graphs: stream capture (thread-local mode) instantiated with `cuGraphInstantiateWithFlags`.
//! - Programmatic dependent launch (compute capability 9.0+, driver 12.3+; `LILY_CUDA_PDL=0` turns
//!   it off): every kernel captured into a decode step's graph is launched with
//!   `cuLaunchKernelEx` and the attribute `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`,
//!   so the graph gets programmatic edges and a kernel may start while the one before it drains.
//!   The kernels make this safe: each waits (`grid_dep_wait`, shaders/cuda/common.cuh) before its
//!   first access to memory other than weights. Prefill chunks (eager or captured) and eager decode
//!   steps stay plain: on the H200 (2026-12-02) the attribute made a decode step 9 % faster (206 ->
//!   226 tok/s at depth 4,100) and a 4,096-token prefill 8 % slower (9,884 -> 9,116 tok/s: the big
//!   GEMMs' early-resident dependents take SM room and gain nothing from a hidden launch gap).
//! - Profile: `LILY_CUDA_PROFILE=1` keeps the graphs and records a CUDA event node between every
//!   two kernels of a captured graph (`CU_EVENT_RECORD_EXTERNAL`), so a kernel's time is the
//!   interval between the event before it and the event after it in a replayed graph; a step's
//!   wall time is timed by events around `cuGraphLaunch`. Eager launches (prefill, the first
//!   steps) are timed by a pair of events each, reported apart. Programmatic dependent launch is
//!   off while profiling: an event node between two kernels leaves no programmatic edge between
//!   them (compare the decode benchmark with and without `LILY_CUDA_PDL=0` for its effect). The
//!   tables go to stderr when the device is dropped. A developer's tool: it allocates per launch.

use std::{
    collections::HashMap,
    ffi::{c_void, CStr, CString},
    sync::{
        atomic::{AtomicBool, Ordering::Relaxed},
        Mutex,
    },
};

use cudarc::driver::sys::{self, CUresult};

use super::{
    executor::{programmatic_launch, Args, DevPtr, Executor, Launch},
    kernels, nvrtc,
};
use crate::error::{Error, Result};

fn check(r: CUresult, what: &str) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut s: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a static string pointer (or leaves it null).
    unsafe { sys::cuGetErrorString(r, &mut s) };
    let msg = if s.is_null() {
        format!("{r:?}")
    } else {
        // SAFETY: a NUL-terminated static string from the driver.
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    };
    Err(Error::Device(format!("CUDA {what}: {msg} ({r:?})")))
}

/// A loaded kernel.
#[derive(Clone, Copy)]
pub struct DeviceFunction(sys::CUfunction);
// SAFETY: CUfunction handles are usable from any thread with the context current.
unsafe impl Send for DeviceFunction {}
unsafe impl Sync for DeviceFunction {}

/// An instantiated graph (and, when profiling, its timing events).
pub struct DeviceGraph(sys::CUgraphExec, GraphEvents);
// SAFETY: a graph exec handle is used by one thread at a time (the backend's stream lock).
unsafe impl Send for DeviceGraph {}
impl Drop for DeviceGraph {
    fn drop(&mut self) {
        // SAFETY: instantiated once, destroyed once; its events are destroyed once with it (a
        // replay still in flight keeps them alive in the driver until it completes).
        unsafe {
            if !self.0.is_null() {
                sys::cuGraphExecDestroy(self.0);
            }
            let wall = self.1.wall.iter().flat_map(|&(a, b)| [a, b]);
            for e in self.1.chain.iter().map(|c| c.1).chain(wall) {
                sys::cuEventDestroy_v2(e);
            }
        }
    }
}

struct Handles {
    ctx: sys::CUcontext,
    stream: sys::CUstream,
    modules: Vec<(&'static str, sys::CUmodule)>,
}
// SAFETY: driver handles are thread-safe; the context is made current on each calling thread.
unsafe impl Send for Handles {}
unsafe impl Sync for Handles {}

pub struct Device {
    h: Handles,
    name: String,
    arch: u32,
    driver: i32,
    sms: i32,
    nvrtc: (i32, i32),
    total: usize,
    /// Live allocations (address -> bytes), their sum and its peak.
    mem: Mutex<(HashMap<DevPtr, usize>, usize, usize)>,
    /// Launch with programmatic stream serialization (see the module doc): whether the device and
    /// driver can (and no profile runs), and whether it is on now.
    pdl_capable: bool,
    pdl: AtomicBool,
    /// Between `capture_begin(true)` and `capture_end`: the launches are nodes of a decode step's
    /// graph (programmatic edges only there).
    capturing: AtomicBool,
    /// `LILY_CUDA_PROFILE`: events of the launches since the last sync, and the totals per kernel.
    profile: Option<Mutex<Profile>>,
}

/// The events of a captured graph: `chain[0]` precedes its first kernel, `chain[i]` (named by
/// kernel i - 1) follows kernel i - 1; `wall` brackets the `cuGraphLaunch` on the stream.
#[derive(Clone, Default)]
struct GraphEvents {
    chain: Vec<(String, sys::CUevent)>,
    wall: Option<(sys::CUevent, sys::CUevent)>,
}

#[derive(Default)]
struct Profile {
    /// Eager launches since the last sync: (kernel, start, end).
    pending: Vec<(String, sys::CUevent, sys::CUevent)>,
    /// Graph replays since the last sync.
    replays: Vec<GraphEvents>,
    /// The chain of the graph being captured (`Some` between capture_begin and capture_end).
    capturing: Option<Vec<(String, sys::CUevent)>>,
    /// kernel -> (launches, milliseconds), eager and inside replayed graphs.
    eager: HashMap<String, (u64, f64)>,
    graph: HashMap<String, (u64, f64)>,
    /// Replays timed, and their summed wall milliseconds.
    steps: (u64, f64),
}
// SAFETY: event handles are usable from any thread with the context current.
unsafe impl Send for Profile {}

impl Device {
    /// Open the device, compile (or load from the cache) every kernel for it.
    pub fn new() -> Result<Device> {
        match std::panic::catch_unwind(Device::open) {
            Ok(r) => r,
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown failure".into());
                Err(Error::Device(format!("CUDA could not be loaded: {msg}")))
            }
        }
    }

    fn open() -> Result<Device> {
        // SAFETY: only tries to open libcuda by its usual names.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::Device(
                "no NVIDIA driver found (libcuda.so.1 could not be loaded): the CUDA backend needs an NVIDIA GPU with its driver installed".into(),
            ));
        }
        // SAFETY: plain driver calls with valid out-pointers.
        unsafe {
            check(
                sys::cuInit(0),
                "cuInit (is an NVIDIA GPU present and its driver loaded?)",
            )?;
            let mut count = 0;
            check(sys::cuDeviceGetCount(&mut count), "cuDeviceGetCount")?;
            let ordinal: i32 = match std::env::var("LILY_CUDA_DEVICE") {
                Ok(v) if !v.trim().is_empty() => v
                    .trim()
                    .parse()
                    .map_err(|_| Error::Device(format!("LILY_CUDA_DEVICE must be a device number, found {v:?}")))?,
                _ => 0,
            };
            if count == 0 || ordinal < 0 || ordinal >= count {
                return Err(Error::Device(format!(
                    "CUDA device {ordinal} requested, {count} device(s) present"
                )));
            }
            let mut dev = 0;
            check(sys::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet")?;
            let attr = |a| -> Result<i32> {
                let mut v = 0;
                check(sys::cuDeviceGetAttribute(&mut v, a, dev), "cuDeviceGetAttribute")?;
                Ok(v)
            };
            use sys::CUdevice_attribute::*;
            let major = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
            let minor = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
            let sms = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
            if major < 8 {
                return Err(Error::Device(format!(
                    "CUDA device {ordinal} has compute capability {major}.{minor}; Lily's kernels need 8.0 or newer (bf16 tensor cores)"
                )));
            }
            let mut name = [0 as std::ffi::c_char; 128];
            check(sys::cuDeviceGetName(name.as_mut_ptr(), 128, dev), "cuDeviceGetName")?;
            let name = CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
            let mut total = 0usize;
            check(sys::cuDeviceTotalMem_v2(&mut total, dev), "cuDeviceTotalMem")?;
            let mut ctx = std::ptr::null_mut();
            check(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), "cuDevicePrimaryCtxRetain")?;
            check(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent")?;
            let mut stream = std::ptr::null_mut();
            check(
                sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32),
                "cuStreamCreate",
            )?;
            let arch = (major * 10 + minor) as u32;
            let mut driver = 0;
            check(sys::cuDriverGetVersion(&mut driver), "cuDriverGetVersion")?;
            let profile = std::env::var("LILY_CUDA_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0");
            let pdl_capable = !profile && programmatic_launch(arch, driver, None);
            let pdl = pdl_capable && programmatic_launch(arch, driver, std::env::var("LILY_CUDA_PDL").ok().as_deref());
            let nvrtc = nvrtc::load()?;
            let mut modules = Vec::new();
            for c in nvrtc::compile_all(arch, true)? {
                let mut m = std::ptr::null_mut();
                check(
                    sys::cuModuleLoadData(&mut m, c.cubin.as_ptr() as *const c_void),
                    &format!("cuModuleLoadData ({})", c.file),
                )?;
                modules.push((c.file, m));
            }
            Ok(Device {
                h: Handles { ctx, stream, modules },
                name,
                arch,
                driver,
                sms,
                nvrtc,
                total,
                mem: Mutex::new((HashMap::new(), 0, 0)),
                pdl_capable,
                pdl: AtomicBool::new(pdl),
                capturing: AtomicBool::new(false),
                profile: profile.then(|| Mutex::new(Profile::default())),
            })
        }
    }

    fn current(&self) -> Result<()> {
        // SAFETY: a valid context retained for the device's lifetime.
        check(unsafe { sys::cuCtxSetCurrent(self.h.ctx) }, "cuCtxSetCurrent")
    }

    fn event(&self) -> Result<sys::CUevent> {
        let mut e = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; default flags (timing on).
        check(unsafe { sys::cuEventCreate(&mut e, 0) }, "cuEventCreate")?;
        Ok(e)
    }

    /// Compute capability as major * 10 + minor (90 on Hopper).
    pub fn arch(&self) -> u32 {
        self.arch
    }

    /// Whether kernels captured into graphs are launched with programmatic dependent launch.
    pub fn programmatic(&self) -> bool {
        self.pdl.load(Relaxed)
    }

    /// Turn programmatic dependent launch on or off for the launches that follow (a graph already
    /// captured keeps its edges); returns whether it is now on (never where the device or driver
    /// lacks it, or while profiling).
    pub fn set_programmatic(&self, on: bool) -> bool {
        let on = on && self.pdl_capable;
        self.pdl.store(on, Relaxed);
        on
    }

    /// The driver's CUDA version as `cuDriverGetVersion` reports it (13000 for CUDA 13.0).
    pub fn driver(&self) -> i32 {
        self.driver
    }

    fn profile(&self) -> Option<std::sync::MutexGuard<'_, Profile>> {
        self.profile
            .as_ref()
            .map(|p| p.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// A new event recorded on the stream; inside a capture an external event node of the graph.
    fn record(&self, capturing: bool) -> Result<sys::CUevent> {
        let e = self.event()?;
        let flags = if capturing {
            sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32
        } else {
            0
        };
        // SAFETY: a fresh event on this context's stream.
        let r = unsafe { sys::cuEventRecordWithFlags(e, self.h.stream, flags) };
        if r != CUresult::CUDA_SUCCESS {
            // SAFETY: created above, not recorded.
            unsafe { sys::cuEventDestroy_v2(e) };
        }
        check(r, "cuEventRecordWithFlags")?;
        Ok(e)
    }

    /// Elapsed milliseconds between two completed events.
    fn elapsed(start: sys::CUevent, end: sys::CUevent) -> Result<f64> {
        let mut ms = 0f32;
        // SAFETY: both events were recorded and the stream is idle.
        check(
            unsafe { sys::cuEventElapsedTime_v2(&mut ms, start, end) },
            "cuEventElapsedTime",
        )?;
        Ok(ms as f64)
    }

    /// Device memory (free, total) in bytes, as the driver reports it.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.current()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers.
        check(unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) }, "cuMemGetInfo")?;
        Ok((free, total))
    }
}

impl Executor for Device {
    const NAME: &'static str = "cuda";
    type Function = DeviceFunction;
    type Graph = DeviceGraph;

    fn describe(&self) -> String {
        format!(
            "{} (sm_{}, {} SMs, {:.1} GiB; kernels compiled by NVRTC {}.{})",
            self.name,
            self.arch,
            self.sms,
            self.total as f64 / (1u64 << 30) as f64,
            self.nvrtc.0,
            self.nvrtc.1
        )
    }

    fn alloc(&self, bytes: usize, label: &str) -> Result<DevPtr> {
        self.current()?;
        let mut p = 0;
        // SAFETY: a plain allocation with a valid out-pointer; zeroed before use.
        unsafe {
            check(
                sys::cuMemAlloc_v2(&mut p, bytes.max(1)),
                &format!("cuMemAlloc of {bytes} bytes ({label})"),
            )?;
            // On the engine's stream (non-blocking: the legacy-stream memset would not be ordered
            // before its kernels).
            check(
                sys::cuMemsetD8Async(p, 0, bytes.max(1), self.h.stream),
                "cuMemsetD8Async",
            )?;
            check(sys::cuStreamSynchronize(self.h.stream), "cuStreamSynchronize")?;
        }
        let mut m = self.mem.lock().unwrap_or_else(|e| e.into_inner());
        m.0.insert(p, bytes);
        m.1 += bytes;
        m.2 = m.2.max(m.1);
        Ok(p)
    }

    fn free(&self, p: DevPtr) {
        let _ = self.current();
        // SAFETY: `p` came from `alloc` and is freed once.
        unsafe { sys::cuMemFree_v2(p) };
        let mut m = self.mem.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = m.0.remove(&p) {
            m.1 -= b;
        }
    }

    fn write(&self, dst: DevPtr, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        self.current()?;
        // SAFETY: `dst` lies in an allocation of at least data.len() bytes (the backend checks).
        // On the engine's stream, then waited for: a synchronous copy from pageable memory may
        // return before its DMA lands, and the legacy stream is not ordered with ours.
        unsafe {
            check(
                sys::cuMemcpyHtoDAsync_v2(dst, data.as_ptr() as *const c_void, data.len(), self.h.stream),
                "cuMemcpyHtoDAsync",
            )?;
            check(sys::cuStreamSynchronize(self.h.stream), "cuStreamSynchronize")
        }
    }

    fn read(&self, src: DevPtr, out: &mut [u8]) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        self.current()?;
        // SAFETY: as `write`.
        unsafe {
            check(
                sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr() as *mut c_void, src, out.len(), self.h.stream),
                "cuMemcpyDtoHAsync",
            )?;
            check(sys::cuStreamSynchronize(self.h.stream), "cuStreamSynchronize")
        }
    }

    fn zero(&self, dst: DevPtr, bytes: usize) -> Result<()> {
        self.current()?;
        // SAFETY: as `write`.
        check(
            unsafe { sys::cuMemsetD8Async(dst, 0, bytes, self.h.stream) },
            "cuMemsetD8Async",
        )
    }

    fn copy(&self, src: DevPtr, dst: DevPtr, bytes: usize) -> Result<()> {
        self.current()?;
        // SAFETY: as `write`.
        check(
            unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, self.h.stream) },
            "cuMemcpyDtoDAsync",
        )
    }

    fn function(&self, name: &str) -> Result<DeviceFunction> {
        self.current()?;
        let cname = CString::new(name).map_err(|_| Error::Device(format!("kernel name {name:?}")))?;
        for (_, m) in &self.h.modules {
            let mut f = std::ptr::null_mut();
            // SAFETY: a loaded module and a NUL-terminated name.
            if unsafe { sys::cuModuleGetFunction(&mut f, *m, cname.as_ptr()) } == CUresult::CUDA_SUCCESS {
                return Ok(DeviceFunction(f));
            }
        }
        let files: Vec<&str> = kernels::SOURCES.iter().map(|(f, _)| *f).collect();
        Err(Error::Device(format!(
            "no CUDA kernel named {name:?} in {}",
            files.join(", ")
        )))
    }

    fn launch(&self, f: &DeviceFunction, name: &str, s: Launch, args: &mut Args) -> Result<()> {
        let mut profile = self.profile();
        // Eager: a pair of events around the launch; captured: the event before the first
        // kernel, then one after each.
        let mut start = None;
        if let Some(p) = profile.as_deref_mut() {
            match &mut p.capturing {
                Some(chain) if chain.is_empty() => chain.push((String::new(), self.record(true)?)),
                Some(_) => {}
                None => start = Some(self.record(false)?),
            }
        }
        let mut ptrs = args.pointers();
        // SAFETY: a zeroed attribute union with one field set, as the driver reads it.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: s.grid[0],
            gridDimY: s.grid[1],
            gridDimZ: s.grid[2],
            blockDimX: s.block[0],
            blockDimY: s.block[1],
            blockDimZ: s.block[2],
            sharedMemBytes: s.shared,
            hStream: self.h.stream,
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: the parameter pointers address `args`' values in the kernel's parameter order
        // (each kernel's arguments are written next to its launch in mod.rs and tested); `config`
        // and `attr` outlive the call. cuLaunchKernelEx is only called where `pdl` found a driver
        // that has it (12.3+).
        let r = unsafe {
            if self.pdl.load(Relaxed) && self.capturing.load(Relaxed) {
                sys::cuLaunchKernelEx(&config, f.0, ptrs.as_mut_ptr(), std::ptr::null_mut())
            } else {
                sys::cuLaunchKernel(
                    f.0,
                    s.grid[0],
                    s.grid[1],
                    s.grid[2],
                    s.block[0],
                    s.block[1],
                    s.block[2],
                    s.shared,
                    self.h.stream,
                    ptrs.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            }
        };
        if r != CUresult::CUDA_SUCCESS {
            if let Some(e) = start {
                // SAFETY: recorded above, never waited on.
                unsafe { sys::cuEventDestroy_v2(e) };
            }
            return check(r, &format!("launch of {name} {s:?}"));
        }
        if let Some(p) = profile.as_deref_mut() {
            let end = self.record(p.capturing.is_some())?;
            if let Some(chain) = &mut p.capturing {
                chain.push((name.to_string(), end));
            } else if let Some(start) = start {
                p.pending.push((name.to_string(), start, end));
            }
        }
        Ok(())
    }

    fn sync(&self) -> Result<()> {
        self.current()?;
        // SAFETY: a valid stream.
        check(unsafe { sys::cuStreamSynchronize(self.h.stream) }, "kernel execution")?;
        if let Some(mut p) = self.profile() {
            for (name, start, end) in std::mem::take(&mut p.pending) {
                let ms = Device::elapsed(start, end);
                // SAFETY: recorded, completed (the stream is idle); destroyed once.
                unsafe {
                    sys::cuEventDestroy_v2(start);
                    sys::cuEventDestroy_v2(end);
                }
                let e = p.eager.entry(name).or_default();
                *e = (e.0 + 1, e.1 + ms?);
            }
            for g in std::mem::take(&mut p.replays) {
                for w in g.chain.windows(2) {
                    let ms = Device::elapsed(w[0].1, w[1].1)?;
                    let e = p.graph.entry(w[1].0.clone()).or_default();
                    *e = (e.0 + 1, e.1 + ms);
                }
                if let Some((start, end)) = g.wall {
                    let ms = Device::elapsed(start, end)?;
                    p.steps = (p.steps.0 + 1, p.steps.1 + ms);
                }
            }
        }
        Ok(())
    }

    fn capture_begin(&self, programmatic: bool) -> Result<bool> {
        self.current()?;
        // SAFETY: a valid stream, not capturing (the backend captures one list at a time).
        check(
            unsafe {
                sys::cuStreamBeginCapture_v2(
                    self.h.stream,
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                )
            },
            "cuStreamBeginCapture",
        )?;
        if let Some(mut p) = self.profile() {
            p.capturing = Some(Vec::new());
        }
        self.capturing.store(programmatic, Relaxed);
        Ok(true)
    }

    fn capture_end(&self) -> Result<DeviceGraph> {
        self.capturing.store(false, Relaxed);
        let mut events = GraphEvents::default();
        if let Some(mut p) = self.profile() {
            events.chain = p.capturing.take().unwrap_or_default();
        }
        // Owned from here: a failure below destroys the events with the graph.
        let mut graph = DeviceGraph(std::ptr::null_mut(), events);
        let mut g = std::ptr::null_mut();
        // SAFETY: ends the capture begun by `capture_begin` on this stream.
        unsafe {
            check(sys::cuStreamEndCapture(self.h.stream, &mut g), "cuStreamEndCapture")?;
            let r = sys::cuGraphInstantiateWithFlags(&mut graph.0, g, 0);
            sys::cuGraphDestroy(g);
            check(r, "cuGraphInstantiate")?;
        }
        if self.profile.is_some() {
            graph.1.wall = Some((self.event()?, self.event()?));
        }
        Ok(graph)
    }

    fn graph_launch(&self, g: &DeviceGraph) -> Result<()> {
        self.current()?;
        let wall = g.1.wall.filter(|_| self.profile.is_some());
        if let Some((start, _)) = wall {
            // SAFETY: the graph's own event, on this context's stream.
            check(unsafe { sys::cuEventRecord(start, self.h.stream) }, "cuEventRecord")?;
        }
        // SAFETY: an instantiated graph on this context's stream.
        check(unsafe { sys::cuGraphLaunch(g.0, self.h.stream) }, "cuGraphLaunch")?;
        if let (Some((_, end)), Some(mut p)) = (wall, self.profile()) {
            // SAFETY: as above.
            check(unsafe { sys::cuEventRecord(end, self.h.stream) }, "cuEventRecord")?;
            p.replays.push(g.1.clone());
        }
        Ok(())
    }

    fn peak_bytes(&self) -> Option<usize> {
        Some(self.mem.lock().unwrap_or_else(|e| e.into_inner()).2)
    }

    fn reset_peak(&self) {
        let mut m = self.mem.lock().unwrap_or_else(|e| e.into_inner());
        m.2 = m.1;
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        if let Some(p) = self.profile() {
            eprint!("{}", p.report());
        }
        // SAFETY: handles created in `open`, destroyed once (the buffers were freed by their
        // owners, which hold the backend and so drop first).
        unsafe {
            let _ = sys::cuCtxSetCurrent(self.h.ctx);
            for (_, m) in &self.h.modules {
                sys::cuModuleUnload(*m);
            }
            sys::cuStreamDestroy_v2(self.h.stream);
        }
    }
}

impl Profile {
    /// The profile's tables: the replayed graphs' kernels (and the step's wall time beside their
    /// sum), then the eager launches; slowest kernel first.
    fn report(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        // `steps`: replays, for the per-step column (eager launches have none).
        let table = |out: &mut String, totals: &HashMap<String, (u64, f64)>, steps: Option<u64>| {
            let mut rows: Vec<_> = totals.iter().collect();
            rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
            let total: f64 = rows.iter().map(|r| r.1 .1).sum();
            let _ = writeln!(
                out,
                "{:>10} {:>7} {:>9} {:>10} {:>9}  kernel",
                "ms", "%", "launches", "us/step", "us/launch"
            );
            for (name, (n, ms)) in rows {
                let per_step = steps.map_or("-".into(), |s| format!("{:.2}", 1e3 * ms / s.max(1) as f64));
                let _ = writeln!(
                    out,
                    "{ms:10.3} {:6.1}% {n:9} {per_step:>10} {:9.2}  {name}",
                    100.0 * ms / total,
                    1e3 * ms / *n as f64
                );
            }
        };
        if !self.graph.is_empty() {
            let (steps, wall) = self.steps;
            let sum: f64 = self.graph.values().map(|v| v.1).sum();
            let _ = writeln!(
                out,
                "lily cuda profile, replayed graphs: {steps} replays, wall {:.1} us a replay (events around cuGraphLaunch), \
                 kernels {:.1} us a replay (events between the graph's kernels: a kernel's time runs from the end of \
                 the one before it, launch gap included); programmatic dependent launch off while profiling",
                1e3 * wall / steps.max(1) as f64,
                1e3 * sum / steps.max(1) as f64,
            );
            table(&mut out, &self.graph, Some(steps));
        }
        if !self.eager.is_empty() {
            let total: f64 = self.eager.values().map(|v| v.1).sum();
            let _ = writeln!(
                out,
                "lily cuda profile, eager launches: {total:.3} ms in kernels (a pair of events around each launch)"
            );
            table(&mut out, &self.eager, None);
        }
        out
    }
}
