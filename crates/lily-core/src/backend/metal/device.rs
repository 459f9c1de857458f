//! The real Metal device (macOS, Apple silicon): the [`Executor`] that `Metal<Device>` drives.
//!
//! - Device: the system default (`MTLCreateSystemDefaultDevice`, which returns nil unless the
//!   process links CoreGraphics: `build.rs` links it), else the first device `MTLCopyAllDevices`
//!   lists that is in GPU family Apple7 or later (every Apple silicon Mac: the kernels rely on
//!   its simdgroup operations and simdgroup matrices). [`probe`] finds it without building the
//!   backend (`lily info`, `backend="auto"`): a Mac whose only Metal devices are below Apple7
//!   (a virtual machine's paravirtual GPU, as on GitHub's hosted runners) has no Metal GPU for
//!   Lily. Its GPU family is the newest `MTLGPUFamilyAppleN` (N = 7..10) that `supportsFamily`
//!   accepts and picks the kernel variants (`kernels::Variants::for_family`);
//!   `LILY_METAL_FAMILY=7..10` picks another family's variants (all run on every Apple7+ GPU).
//! - macOS: 13 or later ([`kernels::MIN_MACOS`]); the shaders are compiled as Metal Shading
//!   Language [`kernels::MSL_VERSION`] (3.0, set explicitly: by default Metal compiles with the
//!   newest version of the running system), which reads bf16 weights as bits (no `bfloat`
//!   type, which needs MSL 3.1 / macOS 14). An older macOS is refused with a message.
//! - Shaders: the sources embedded in `kernels.rs`, one library per `.metal` file with the
//!   headers inlined (`kernels::standalone`), compiled at construction with
//!   `newLibraryWithSource` (fast math on; `LILY_METAL_FAST_MATH=0` turns it off when hunting
//!   a parity bug); a compile error is a `DeviceError` carrying the compiler's log. Pipelines
//!   are built by `Metal` for the kernels the checkpoint's weight formats need.
//! - Memory: every buffer is `StorageModeShared` (unified memory: the CPU reads and writes it
//!   through `contents`). Weights are wrapped in place with `newBufferWithBytesNoCopy` over
//!   the page-aligned region of the mapped checkpoint that covers the tensor
//!   ([`executor::wrappable`]); the tensor's offset inside that region goes to the kernel as the
//!   binding offset. Where that is not possible (offset not 4-byte aligned, region over
//!   `maxBufferLength`, wrapping refused) the tensor is copied once, and counted
//!   (`Metal::copied_weight_bytes`). `recommendedMaxWorkingSetSize` is the budget the engine
//!   checks weights, state and KV cache against at load.
//! - Commands: one command buffer with one serial compute encoder per command stream of the
//!   `Metal` stream (a decode step; a long prefill chunk is committed in pieces, see
//!   `stream.rs`), committed without waiting (`commit`) and waited for at `wait`, where its
//!   error, if any, comes back as `Error::Device`.
//! - Autorelease pools: Metal returns command buffers, encoders and errors autoreleased; without
//!   a pool they would pile up for the life of the thread. One pool spans each command buffer
//!   from its creation to its commit (pushed in `encoder`, popped in `commit`), one its wait;
//!   dispatches open none (their calls return nothing autoreleased, and a pool per dispatch
//!   costs a push and a pop on every kernel of every step).
//! - Debug labels (for Xcode GPU captures and Instruments), off unless `LILY_METAL_LABELS=1`
//!   or a capture (`LILY_METAL_CAPTURE`) asks for them: the command buffer is labelled
//!   "lily step N" (a one-token forward), "lily prefill chunk" or "lily commands", its compute
//!   encoder "lily decode" / "lily prefill" / "lily commands", and every dispatch sits in a
//!   debug group named after its kernel (`matmul_gemv_q4_bf16_r4`, ...). The NSStrings are made
//!   once (per pipeline, per label kind): a dispatch allocates nothing for its label, a decode
//!   step one NSString (its number, formatted on the stack).
//! - Host allocations: a dispatch allocates nothing on the Rust side (its parameter bytes come
//!   inline, the no-copy weights it binds go into a list reused from stream to stream); what
//!   Metal itself allocates per command buffer is Metal's.
//! - GPU capture: `LILY_METAL_CAPTURE=/path/trace.gputrace` captures the first
//!   `LILY_METAL_CAPTURE_COMMANDS` command buffers (default 1: the first prefill chunk) of the
//!   queue into that file through `MTLCaptureManager` (destination `GPUTraceDocument`); open
//!   it in Xcode. Metal allows this outside Xcode only when the process starts with
//!   `MTL_CAPTURE_ENABLED=1` in its environment; without it (or with a trace file that already
//!   exists) `Device::new` fails with a `DeviceError` that says so. The capture stops after
//!   those command buffers complete, or when the device is dropped.
//!
//! Thread safety: `MTLDevice`, `MTLCommandQueue`, `MTLLibrary` and pipeline states are
//! thread-safe (objc2-metal marks them `Send + Sync`). Buffers and command buffers are not
//! marked; the wrappers below assert `Send`/`Sync` with the reason at each `unsafe impl`.

use std::{
    ffi::{c_int, c_void},
    path::{Path, PathBuf},
    ptr::NonNull,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    thread::ThreadId,
};

use objc2::{
    ffi::{objc_autoreleasePoolPop, objc_autoreleasePoolPush},
    rc::{autoreleasepool, Retained},
    runtime::{AnyObject, ProtocolObject},
};
use objc2_foundation::{NSError, NSProcessInfo, NSString, NSURL};
use objc2_metal::{
    MTLBuffer, MTLCaptureDescriptor, MTLCaptureDestination, MTLCaptureManager, MTLCommandBuffer,
    MTLCommandBufferStatus, MTLCommandEncoder, MTLCommandQueue, MTLCompileOptions, MTLComputeCommandEncoder,
    MTLComputePipelineState, MTLCopyAllDevices, MTLCreateSystemDefaultDevice, MTLDevice, MTLGPUFamily,
    MTLLanguageVersion, MTLLibrary, MTLResource, MTLResourceOptions, MTLResourceUsage, MTLSize,
};

use super::{
    executor::{wrappable, Arg, DeviceInfo, Executor, GpuFamily, Grid, Placed, StreamLabel},
    kernels::{self, MIN_MACOS, MSL_VERSION},
};
use crate::{
    error::{Error, Result},
    safetensors::Bytes,
};

extern "C" {
    /// libc (libSystem on macOS): the VM page size (16 KiB on Apple silicon).
    fn getpagesize() -> c_int;
    /// libSystem: read a kernel variable by name.
    fn sysctlbyname(
        name: *const std::ffi::c_char,
        oldp: *mut c_void,
        oldlenp: *mut usize,
        newp: *mut c_void,
        newlen: usize,
    ) -> c_int;
}

/// Whether this macOS runs in a virtual machine (`sysctl kern.hv_vmm_present`), whose Metal
/// device, if it has one, is a paravirtual one (GitHub's hosted runners, UTM, Parallels) below
/// GPU family Apple7. Said in the device tests' messages; the one place a Mac may list no
/// Metal device at all (every Mac that runs macOS 13 has a Metal GPU).
pub fn in_virtual_machine() -> bool {
    let (mut v, mut len): (c_int, usize) = (0, std::mem::size_of::<c_int>());
    // SAFETY: a NUL-terminated name, an int-sized output buffer with its length, no new value.
    let rc = unsafe {
        sysctlbyname(
            c"kern.hv_vmm_present".as_ptr(),
            (&raw mut v).cast(),
            &mut len,
            std::ptr::null_mut(),
            0,
        )
    };
    rc == 0 && v == 1
}

type MtlDevice = Retained<ProtocolObject<dyn MTLDevice>>;

/// The newest `MTLGPUFamilyAppleN` device `d` supports: N, or 0 for none (N = 1..=10; the family
/// values are 1000 + N).
fn newest_apple_family(d: &ProtocolObject<dyn MTLDevice>) -> u32 {
    (1..=10u32)
        .rev()
        .find(|&n| d.supportsFamily(MTLGPUFamily(1000 + n as isize)))
        .unwrap_or(0)
}

/// Whether Metal lists any device at all, of any GPU family (the system default or one of
/// `MTLCopyAllDevices`): what tells "this machine has no Metal device" (the one reason the
/// device tests may skip) from "it has one Lily cannot run on" (a failure) when [`probe`] fails.
pub fn any_device() -> bool {
    autoreleasepool(|_| MTLCreateSystemDefaultDevice().is_some() || !MTLCopyAllDevices().to_vec().is_empty())
}

/// The Metal GPU Lily's kernels run on (GPU family Apple7 or later) and its family, or why this
/// Mac has none. The system default device first; if there is none (or it is below Apple7),
/// every device `MTLCopyAllDevices` lists.
fn find_gpu() -> std::result::Result<(MtlDevice, GpuFamily), String> {
    let mut devices: Vec<MtlDevice> = MTLCreateSystemDefaultDevice().into_iter().collect();
    devices.extend(MTLCopyAllDevices().to_vec());
    if devices.is_empty() {
        return Err(
            "no Metal device: MTLCreateSystemDefaultDevice returned nil and MTLCopyAllDevices lists none".into(),
        );
    }
    let mut seen = Vec::new();
    for d in devices {
        let n = newest_apple_family(&d);
        if let Some(family) = GpuFamily::from_number(n.min(GpuFamily::NEWEST.number())) {
            return Ok((d, family));
        }
        let family = if n == 0 {
            "no Apple GPU family".to_string()
        } else {
            format!("GPU family Apple{n}")
        };
        let entry = format!("{:?} ({family})", d.name().to_string());
        if !seen.contains(&entry) {
            seen.push(entry);
        }
    }
    Err(format!(
        "no Metal GPU of family Apple7 or later (M1 and later): this Mac's Metal devices are {}. On Apple \
         silicon that is a virtual machine's paravirtual GPU (GitHub's hosted macOS runners, UTM, \
         Parallels), which runs no Lily kernels; an Intel Mac's GPU is not supported either",
        seen.join(", ")
    ))
}

fn device_info(d: &ProtocolObject<dyn MTLDevice>, family: GpuFamily) -> DeviceInfo {
    DeviceInfo {
        name: d.name().to_string(),
        family,
        working_set: d.recommendedMaxWorkingSetSize(),
        unified_memory: d.hasUnifiedMemory(),
        max_buffer_length: d.maxBufferLength() as u64,
    }
}

/// The Metal GPU this Mac would run Lily on, or why there is none (no Metal device, or only
/// devices below GPU family Apple7). Opens nothing else: `lily info` and `backend="auto"` ask
/// this before building the backend, whose own errors (an old macOS, a shader that does not
/// compile) are then errors, never a reason to fall back to the CPU.
pub fn probe() -> std::result::Result<DeviceInfo, String> {
    autoreleasepool(|_| find_gpu().map(|(d, f)| device_info(&d, f)))
}

/// The running macOS release (major, minor, patch) and its description ("Version 14.5 (Build
/// 23F79)"), from `NSProcessInfo`.
pub fn macos_version() -> ((u32, u32, u32), String) {
    autoreleasepool(|_| {
        let info = NSProcessInfo::processInfo();
        let v = info.operatingSystemVersion();
        let n = |x: isize| u32::try_from(x).unwrap_or(0);
        (
            (n(v.majorVersion), n(v.minorVersion), n(v.patchVersion)),
            info.operatingSystemVersionString().to_string(),
        )
    })
}

/// The Metal device, its queue and the compiled shader libraries.
pub struct Device {
    device: MtlDevice,
    queue: Retained<ProtocolObject<dyn MTLCommandQueue>>,
    libs: Vec<Retained<ProtocolObject<dyn MTLLibrary>>>,
    info: DeviceInfo,
    fast_math: bool,
    page: usize,
    /// The family whose kernel variants are used (`LILY_METAL_FAMILY` or `info.family`).
    family: GpuFamily,
    /// The fixed command-buffer and encoder labels; None unless asked for.
    labels: Option<Labels>,
    /// The GPU capture in progress (`LILY_METAL_CAPTURE`).
    capture: Option<Capture>,
    /// The emptied `DeviceEncoder::keep` list of the last command stream waited for, reused by
    /// the next (so binding weights allocates nothing once warm).
    spare_keep: Mutex<Vec<DeviceBuffer>>,
}

/// An immutable NSString (made by `NSString::from_str`, never an NSMutableString): a debug
/// label made once and read from any thread.
struct Label(Retained<NSString>);

// SAFETY: an immutable NSString is thread-safe; nothing mutates it after creation.
unsafe impl Send for Label {}
unsafe impl Sync for Label {}

impl Label {
    fn new(s: &str) -> Label {
        Label(NSString::from_str(s))
    }
}

/// The label strings that do not change, made once.
struct Labels {
    prefill: Label,
    commands: Label,
    enc_decode: Label,
    enc_prefill: Label,
    enc_commands: Label,
}

impl Labels {
    fn new() -> Labels {
        let ns = Label::new;
        Labels {
            prefill: ns(&StreamLabel::PrefillChunk.to_string()),
            commands: ns(&StreamLabel::Commands.to_string()),
            enc_decode: ns(StreamLabel::Step(0).encoder()),
            enc_prefill: ns(StreamLabel::PrefillChunk.encoder()),
            enc_commands: ns(StreamLabel::Commands.encoder()),
        }
    }

    fn encoder(&self, l: StreamLabel) -> &NSString {
        match l {
            StreamLabel::Step(_) => &self.enc_decode.0,
            StreamLabel::PrefillChunk => &self.enc_prefill.0,
            StreamLabel::Commands => &self.enc_commands.0,
        }
    }
}

/// A GPU capture into a `.gputrace` file, stopped after `left` more command buffers complete.
struct Capture {
    path: PathBuf,
    left: AtomicUsize,
}

/// A shared-storage `MTLBuffer`; `_keep` holds the mapped checkpoint a no-copy buffer wraps.
pub struct BufferInner {
    buf: Retained<ProtocolObject<dyn MTLBuffer>>,
    _keep: Option<Bytes>,
}

// SAFETY: Metal resources may be used from any thread; the engine orders all access through
// its command stream (the CPU touches `contents` only when no GPU work is pending).
unsafe impl Send for BufferInner {}
unsafe impl Sync for BufferInner {}

/// A retained buffer handle; clones share the buffer.
#[derive(Clone)]
pub struct DeviceBuffer(Arc<BufferInner>);

/// A compute pipeline, the largest threadgroup it accepts and its kernel name as an NSString
/// (the debug group of its dispatches, made once).
pub struct DevicePipeline {
    state: Retained<ProtocolObject<dyn MTLComputePipelineState>>,
    max_threads: usize,
    label: Label,
}

/// The autorelease pool of one command buffer: pushed when it is created, popped after its
/// commit, on the thread that pushed it (a pool belongs to its thread).
struct Pool {
    token: NonNull<c_void>,
    thread: ThreadId,
}

// SAFETY: the token is only popped on the thread that pushed it (checked in `pop`).
unsafe impl Send for Pool {}

impl Pool {
    fn push() -> Pool {
        // SAFETY: pushing a pool has no preconditions; it returns a non-null token.
        let token = unsafe { objc_autoreleasePoolPush() };
        Pool {
            token: NonNull::new(token).unwrap_or(NonNull::dangling()),
            thread: std::thread::current().id(),
        }
    }

    /// Drain the pool. On another thread than the one that pushed it, nothing is popped: the
    /// objects stay in that thread's pool stack until an enclosing pool drains (the engine
    /// encodes and commits a stream in one call, on one thread, so this does not happen there).
    fn pop(self) {
        if std::thread::current().id() == self.thread {
            // SAFETY: the token of a pool pushed on this thread and not popped yet; pools pushed
            // above it since (pipeline builds) were closure-scoped and are popped already.
            unsafe { objc_autoreleasePoolPop(self.token.as_ptr()) }
        }
    }
}

/// One command buffer with its open compute encoder.
pub struct DeviceEncoder {
    cb: Retained<ProtocolObject<dyn MTLCommandBuffer>>,
    enc: Retained<ProtocolObject<dyn MTLComputeCommandEncoder>>,
    ended: bool,
    /// No-copy weight buffers bound so far: their mapping must outlive the GPU's use of it.
    keep: Vec<DeviceBuffer>,
    /// The first dispatch this device cannot run (reported by `commit`).
    error: Option<Error>,
    pool: Option<Pool>,
}

// SAFETY: a command buffer and its encoder are used by one thread at a time (the engine keeps
// the open encoder behind a mutex) and are not shared; Metal allows encoding on any thread.
unsafe impl Send for DeviceEncoder {}

impl DeviceEncoder {
    fn end(&mut self) {
        if !self.ended {
            self.enc.endEncoding();
            self.ended = true;
        }
    }
}

impl Drop for DeviceEncoder {
    /// An encoder dropped without `commit` (an encoding error was reported instead) must still
    /// end encoding (Metal asserts on an encoder released while open) and drain its pool.
    fn drop(&mut self) {
        self.end();
        if let Some(p) = self.pool.take() {
            p.pop();
        }
    }
}

/// A committed command buffer and the no-copy weights it reads.
pub struct DevicePending {
    cb: Retained<ProtocolObject<dyn MTLCommandBuffer>>,
    keep: Vec<DeviceBuffer>,
}

// SAFETY: a committed command buffer is only waited for and queried (status, error), which
// Metal allows from any thread.
unsafe impl Send for DevicePending {}

/// An `NSError` in words: its description and, for the shader compiler, the compiler's log
/// (Metal puts the log in the description of an `MTLLibraryErrorDomain` error).
fn ns_error(e: &NSError) -> String {
    let mut s = e.localizedDescription().to_string();
    if let Some(r) = e.localizedFailureReason() {
        let r = r.to_string();
        if !s.contains(&r) {
            s = format!("{s} ({r})");
        }
    }
    format!("{s} [{} error {}]", e.domain(), e.code())
}

impl Device {
    /// Open the Metal GPU ([`probe`]'s) and compile every shader file, calling
    /// `progress(done, total)` after each.
    pub fn new(progress: &mut dyn FnMut(usize, usize) -> Result<()>) -> Result<Device> {
        autoreleasepool(|_| Self::open(progress))
    }

    fn open(progress: &mut dyn FnMut(usize, usize) -> Result<()>) -> Result<Device> {
        let (device, hw_family) = find_gpu().map_err(Error::Device)?;
        let info = device_info(&device, hw_family);
        let name = &info.name;
        let ((major, minor, patch), os) = macos_version();
        if (major, minor) < MIN_MACOS {
            return Err(Error::Device(format!(
                "Lily's Metal backend needs macOS {}.{} or later (its shaders are Metal Shading Language {}.{}); \
                 this Mac ({name}) runs macOS {major}.{minor}.{patch} ({os}): update macOS, or use backend=\"cpu\"",
                MIN_MACOS.0, MIN_MACOS.1, MSL_VERSION.0, MSL_VERSION.1
            )));
        }
        let family = GpuFamily::from_env()?.unwrap_or(hw_family);
        let queue = device
            .newCommandQueue()
            .ok_or_else(|| Error::Device(format!("Metal device {name:?}: cannot create a command queue")))?;
        let capture_path = std::env::var_os("LILY_METAL_CAPTURE").filter(|v| !v.is_empty());
        // Labels cost an NSString per decode step and a debug group per dispatch: only when asked
        // for, or when a capture will be read.
        let labels =
            (std::env::var("LILY_METAL_LABELS").is_ok_and(|v| v == "1") || capture_path.is_some()).then(Labels::new);
        if labels.is_some() {
            queue.setLabel(Some(&NSString::from_str("lily")));
        }
        let fast_math = std::env::var("LILY_METAL_FAST_MATH").map_or(true, |v| v != "0");
        let opts = MTLCompileOptions::new();
        // setMathMode replaces this from macOS 15 only; fastMathEnabled works on every macOS.
        #[allow(deprecated)]
        opts.setFastMathEnabled(fast_math);
        // Without it Metal compiles with the newest language version of the running macOS: the
        // shaders must mean the same on every supported release.
        opts.setLanguageVersion(MTLLanguageVersion(((MSL_VERSION.0 << 16) + MSL_VERSION.1) as usize));
        let files: Vec<(&str, &str)> = kernels::metal_files().collect();
        let mut libs = Vec::new();
        for (i, (file, src)) in files.iter().enumerate() {
            let source = NSString::from_str(&kernels::standalone(file, src));
            let lib = device
                .newLibraryWithSource_options_error(&source, Some(&opts))
                .map_err(|e| {
                    Error::Device(format!(
                        "Metal: shaders/metal/{file} does not compile on {name} (macOS {major}.{minor}.{patch}, Metal Shading Language {}.{}): {}",
                        MSL_VERSION.0,
                        MSL_VERSION.1,
                        ns_error(&e)
                    ))
                })?;
            libs.push(lib);
            progress(i + 1, files.len())?;
        }
        // SAFETY: getpagesize has no preconditions.
        let page = usize::try_from(unsafe { getpagesize() }).unwrap_or(16384).max(4096);
        let capture = match capture_path {
            Some(path) => Some(start_capture(&queue, Path::new(&path))?),
            None => None,
        };
        Ok(Device {
            device,
            queue,
            libs,
            info,
            fast_math,
            page,
            family,
            labels,
            capture,
            spare_keep: Mutex::new(Vec::new()),
        })
    }

    /// The GPU as `lily info` reports it.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn wrap(&self, buf: Option<Retained<ProtocolObject<dyn MTLBuffer>>>, bytes: usize) -> Result<DeviceBuffer> {
        let buf = buf.ok_or_else(|| {
            Error::Device(format!(
                "Metal: cannot allocate a buffer of {bytes} bytes on {} (out of memory or over maxBufferLength {})",
                self.info.name, self.info.max_buffer_length
            ))
        })?;
        Ok(DeviceBuffer(Arc::new(BufferInner { buf, _keep: None })))
    }

    /// Wrap the page-aligned region covering `data` without copying: the buffer and the offset
    /// of `data` in it, or None where Metal cannot take that region as is.
    fn wrap_in_place(&self, data: &Bytes) -> Option<(DeviceBuffer, usize)> {
        let ptr = data.as_slice().as_ptr() as usize;
        let (start, len, offset) = wrappable(ptr, data.len(), self.page, self.device.maxBufferLength())?;
        let base = NonNull::new(start as *mut c_void)?;
        // SAFETY: [start, start + len) is mapped readable for as long as `data`'s mapping lives
        // (whole pages of it), and the returned buffer keeps a clone of `data` (so the mapping)
        // alive; kernels only read weight buffers. No deallocator: the memory is the mapping's.
        let buf = unsafe {
            self.device.newBufferWithBytesNoCopy_length_options_deallocator(
                base,
                len,
                MTLResourceOptions::StorageModeShared,
                None,
            )
        }?;
        let inner = BufferInner {
            buf,
            _keep: Some(data.clone()),
        };
        Some((DeviceBuffer(Arc::new(inner)), offset))
    }
}

/// `args` formatted into `buf` (truncated at its end, on a character boundary), no allocation.
fn format_on_stack<'a>(buf: &'a mut [u8], args: std::fmt::Arguments<'_>) -> &'a str {
    struct Cursor<'b> {
        buf: &'b mut [u8],
        at: usize,
    }
    impl std::fmt::Write for Cursor<'_> {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            let mut n = s.len().min(self.buf.len() - self.at);
            while !s.is_char_boundary(n) {
                n -= 1;
            }
            self.buf[self.at..self.at + n].copy_from_slice(&s.as_bytes()[..n]);
            self.at += n;
            Ok(())
        }
    }
    let at = {
        let mut c = Cursor { buf: &mut *buf, at: 0 };
        let _ = std::fmt::Write::write_fmt(&mut c, args);
        c.at
    };
    let buf: &'a [u8] = buf;
    // Only whole characters were copied.
    std::str::from_utf8(&buf[..at]).unwrap_or("")
}

fn size(v: [u32; 3]) -> MTLSize {
    MTLSize {
        width: v[0] as usize,
        height: v[1] as usize,
        depth: v[2] as usize,
    }
}

impl Executor for Device {
    const NAME: &'static str = "metal";
    type Buffer = DeviceBuffer;
    type Pipeline = DevicePipeline;
    type Encoder = DeviceEncoder;
    type Pending = DevicePending;

    fn describe(&self) -> String {
        let hw = self.info.family;
        let family = if self.family == hw {
            format!("GPU family {hw}")
        } else {
            format!(
                "GPU family {hw}, kernel variants of {} (LILY_METAL_FAMILY)",
                self.family
            )
        };
        let capture = match &self.capture {
            Some(c) => format!("; capturing to {}", c.path.display()),
            None => String::new(),
        };
        format!(
            "Metal on {} ({family}; fast math {}{capture})",
            self.info.name,
            if self.fast_math { "on" } else { "off" }
        )
    }

    fn family(&self) -> GpuFamily {
        self.family
    }

    fn working_set(&self) -> Option<u64> {
        Some(self.info.working_set)
    }

    fn new_buffer(&self, bytes: usize) -> Result<DeviceBuffer> {
        // Shared storage is zero-filled on allocation.
        let len = bytes.max(16);
        self.wrap(
            self.device
                .newBufferWithLength_options(len, MTLResourceOptions::StorageModeShared),
            len,
        )
    }

    fn new_buffer_with(&self, data: &[u8]) -> Result<DeviceBuffer> {
        let Some(ptr) = NonNull::new(data.as_ptr() as *mut c_void).filter(|_| !data.is_empty()) else {
            return self.new_buffer(0);
        };
        // SAFETY: `ptr` addresses data.len() readable bytes; Metal copies them before returning.
        let buf = unsafe {
            self.device
                .newBufferWithBytes_length_options(ptr, data.len(), MTLResourceOptions::StorageModeShared)
        };
        self.wrap(buf, data.len())
    }

    fn weight_buffer(&self, data: &Bytes) -> Result<Placed<DeviceBuffer>> {
        Ok(match self.wrap_in_place(data) {
            Some((buf, offset)) => Placed {
                buf,
                offset,
                copied: false,
            },
            None => Placed {
                buf: self.new_buffer_with(data.as_slice())?,
                offset: 0,
                copied: true,
            },
        })
    }

    fn contents(&self, b: &DeviceBuffer) -> *mut u8 {
        b.0.buf.contents().as_ptr() as *mut u8
    }

    fn gpu_address(&self, b: &DeviceBuffer) -> u64 {
        b.0.buf.gpuAddress()
    }

    /// `useResource:usage:` read + write for each buffer: Metal must know every buffer a kernel
    /// reaches through a GPU address (Apple's "Improving CPU performance by using argument
    /// buffers": resources referenced indirectly must be made resident by the encoder).
    fn use_resources(&self, e: &mut DeviceEncoder, bufs: &[DeviceBuffer]) {
        if e.error.is_some() {
            return;
        }
        for b in bufs {
            let res: &ProtocolObject<dyn MTLResource> = ProtocolObject::from_ref(&*b.0.buf);
            e.enc
                .useResource_usage(res, MTLResourceUsage::Read | MTLResourceUsage::Write);
        }
    }

    fn pipeline(&self, name: &str) -> Result<DevicePipeline> {
        autoreleasepool(|_| self.build_pipeline(name))
    }

    fn encoder(&self, label: StreamLabel) -> Result<DeviceEncoder> {
        // The command buffer's pool: everything Metal autoreleases while it is created and
        // encoded is drained at its commit.
        let pool = Pool::push();
        match self.open_encoder(label) {
            Ok(mut e) => {
                e.pool = Some(pool);
                Ok(e)
            }
            Err(err) => {
                pool.pop();
                Err(err)
            }
        }
    }

    fn dispatch(
        &self,
        e: &mut DeviceEncoder,
        name: &str,
        p: &DevicePipeline,
        args: &[Arg<'_, DeviceBuffer>],
        grid: Grid,
        tg_mem: &[usize],
    ) {
        if e.error.is_some() {
            return;
        }
        let (Grid::Groups { size: tg, .. } | Grid::Threads { size: tg, .. }) = grid;
        let threads = tg.iter().map(|&v| v as usize).product::<usize>();
        if threads > p.max_threads {
            e.error = Some(Error::Device(format!(
                "Metal: {name} needs {threads} threads per threadgroup, the pipeline allows {} on {}",
                p.max_threads, self.info.name
            )));
            return;
        }
        let empty = match grid {
            Grid::Groups { count, .. } => count.contains(&0),
            Grid::Threads { threads, .. } => threads.contains(&0),
        };
        if empty {
            return; // nothing to run (Metal rejects empty grids)
        }
        for a in args {
            if let Arg::Buf(b, off, len) = a {
                if *off + *len > b.0.buf.length() {
                    e.error = Some(Error::Device(format!(
                        "Metal: {name}: binding {len} bytes at offset {off} of a {}-byte buffer",
                        b.0.buf.length()
                    )));
                    return;
                }
            }
        }
        // Everything below is encoded: the debug group is always popped.
        if self.labels.is_some() {
            e.enc.pushDebugGroup(&p.label.0);
        }
        e.enc.setComputePipelineState(&p.state);
        for (i, a) in args.iter().enumerate() {
            match a {
                Arg::Bytes(b) => {
                    let b = b.as_slice();
                    let Some(ptr) = NonNull::new(b.as_ptr() as *mut c_void) else {
                        continue;
                    };
                    // SAFETY: `b` holds b.len() bytes (a parameter struct, under setBytes' 4 KiB
                    // limit); Metal copies them into the command buffer before returning.
                    unsafe { e.enc.setBytes_length_atIndex(ptr, b.len(), i) };
                }
                Arg::Buf(b, off, _) => {
                    // SAFETY: a live buffer of this device; the binding lies inside it (checked
                    // above).
                    unsafe { e.enc.setBuffer_offset_atIndex(Some(&b.0.buf), *off, i) };
                    if b.0._keep.is_some() {
                        e.keep.push((*b).clone());
                    }
                }
            }
        }
        for (i, &bytes) in tg_mem.iter().enumerate() {
            // SAFETY: a length rounded up to 16 bytes (Metal's rule) for `[[threadgroup(i)]]`;
            // the kernels need at most 20 KiB in all (moe_gemm_gate_up_*_n64, delta_net_chunk at
            // Dk = 256), under every Apple7+ GPU's 32 KiB.
            unsafe { e.enc.setThreadgroupMemoryLength_atIndex(bytes.div_ceil(16) * 16, i) };
        }
        match grid {
            Grid::Groups { count, size: s } => e.enc.dispatchThreadgroups_threadsPerThreadgroup(size(count), size(s)),
            Grid::Threads { threads, size: s } => e.enc.dispatchThreads_threadsPerThreadgroup(size(threads), size(s)),
        }
        if self.labels.is_some() {
            e.enc.popDebugGroup();
        }
    }

    fn commit(&self, mut e: DeviceEncoder) -> Result<DevicePending> {
        e.end();
        if let Some(err) = e.error.take() {
            return Err(err); // dropping `e` drains its pool
        }
        e.cb.commit();
        let pending = DevicePending {
            cb: e.cb.clone(),
            keep: std::mem::take(&mut e.keep),
        };
        drop(e); // drains the command buffer's pool (the buffer itself is retained by `pending`)
        Ok(pending)
    }

    fn wait(&self, p: DevicePending) -> Result<()> {
        autoreleasepool(|_| self.complete(p))
    }
}

impl Device {
    fn build_pipeline(&self, name: &str) -> Result<DevicePipeline> {
        let ns = NSString::from_str(name);
        let Some(f) = self.libs.iter().find_map(|l| l.newFunctionWithName(&ns)) else {
            return Err(Error::Device(format!(
                "Metal: no kernel named {name:?} in the compiled shaders"
            )));
        };
        let state = self.device.newComputePipelineStateWithFunction_error(&f).map_err(|e| {
            Error::Device(format!(
                "Metal: the pipeline of kernel {name} cannot be built on {}: {}",
                self.info.name,
                ns_error(&e)
            ))
        })?;
        let max_threads = state.maxTotalThreadsPerThreadgroup();
        Ok(DevicePipeline {
            state,
            max_threads,
            label: Label(ns),
        })
    }

    fn open_encoder(&self, label: StreamLabel) -> Result<DeviceEncoder> {
        let cb = self
            .queue
            .commandBuffer()
            .ok_or_else(|| Error::Device("Metal: cannot create a command buffer".into()))?;
        if let Some(l) = &self.labels {
            match label {
                StreamLabel::Step(_) => {
                    // "lily step N" formatted on the stack: the NSString is the step's only label
                    // allocation.
                    let mut buf = [0u8; 48];
                    let text = format_on_stack(&mut buf, format_args!("{label}"));
                    cb.setLabel(Some(&NSString::from_str(text)))
                }
                StreamLabel::PrefillChunk => cb.setLabel(Some(&l.prefill.0)),
                StreamLabel::Commands => cb.setLabel(Some(&l.commands.0)),
            }
        }
        let enc = cb
            .computeCommandEncoder()
            .ok_or_else(|| Error::Device("Metal: cannot create a compute encoder".into()))?;
        if let Some(l) = &self.labels {
            enc.setLabel(Some(l.encoder(label)));
        }
        let keep = std::mem::take(&mut *self.spare_keep.lock().unwrap_or_else(|e| e.into_inner()));
        Ok(DeviceEncoder {
            cb,
            enc,
            ended: false,
            keep,
            error: None,
            pool: None,
        })
    }

    fn complete(&self, mut p: DevicePending) -> Result<()> {
        p.cb.waitUntilCompleted();
        // The GPU is done with the weights: hand the emptied list to the next command stream.
        p.keep.clear();
        *self.spare_keep.lock().unwrap_or_else(|e| e.into_inner()) = std::mem::take(&mut p.keep);
        self.count_captured();
        if p.cb.status() == MTLCommandBufferStatus::Error {
            let why =
                p.cb.error()
                    .map_or_else(|| "unknown error".to_string(), |err| ns_error(&err));
            return Err(Error::Device(format!(
                "Metal command buffer failed on {}: {why}",
                self.info.name
            )));
        }
        Ok(())
    }
}

/// Start capturing the command buffers of `queue` into the `.gputrace` file `path`, for
/// `LILY_METAL_CAPTURE_COMMANDS` (default 1) of them.
fn start_capture(queue: &ProtocolObject<dyn MTLCommandQueue>, path: &Path) -> Result<Capture> {
    let shown = path.display();
    if path.extension().is_none_or(|e| e != "gputrace") {
        return Err(Error::Device(format!(
            "LILY_METAL_CAPTURE must name a .gputrace file to write, found {shown:?}"
        )));
    }
    if path.exists() {
        return Err(Error::Device(format!(
            "LILY_METAL_CAPTURE: {shown} already exists (Metal does not overwrite a trace): remove it or choose another name"
        )));
    }
    let commands = match std::env::var("LILY_METAL_CAPTURE_COMMANDS") {
        Ok(v) => v.trim().parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| {
            Error::Device(format!(
                "LILY_METAL_CAPTURE_COMMANDS must be a positive number of command buffers, found {v:?}"
            ))
        })?,
        Err(_) => 1,
    };
    // SAFETY: the shared capture manager is a process-wide singleton; this thread uses it while
    // no capture of ours runs yet.
    let manager = unsafe { MTLCaptureManager::sharedCaptureManager() };
    if !manager.supportsDestination(MTLCaptureDestination::GPUTraceDocument) {
        let why = if std::env::var_os("MTL_CAPTURE_ENABLED").is_none_or(|v| v != "1") {
            "Metal writes GPU traces outside Xcode only when the process starts with MTL_CAPTURE_ENABLED=1 in its environment (run e.g. `MTL_CAPTURE_ENABLED=1 LILY_METAL_CAPTURE=/tmp/lily.gputrace python ...`)"
        } else {
            "MTL_CAPTURE_ENABLED=1 is set, but this system still refuses GPU-trace documents (a macOS without the Metal developer tools?)"
        };
        return Err(Error::Device(format!(
            "LILY_METAL_CAPTURE={shown}: GPU capture to a .gputrace file is not supported here: {why}"
        )));
    }
    let desc = MTLCaptureDescriptor::new();
    let queue_obj: &AnyObject = queue.as_ref();
    // SAFETY: the capture object is a command queue, one of the kinds Metal accepts.
    unsafe { desc.setCaptureObject(Some(queue_obj)) };
    desc.setDestination(MTLCaptureDestination::GPUTraceDocument);
    let url = NSURL::fileURLWithPath(&NSString::from_str(&path.to_string_lossy()));
    desc.setOutputURL(Some(&url));
    manager.startCaptureWithDescriptor_error(&desc).map_err(|e| {
        Error::Device(format!(
            "LILY_METAL_CAPTURE: the GPU capture to {shown} did not start: {}",
            ns_error(&e)
        ))
    })?;
    Ok(Capture {
        path: path.to_path_buf(),
        left: AtomicUsize::new(commands),
    })
}

impl Device {
    /// One more captured command buffer has completed: stop the capture (which writes the
    /// trace) after the last one.
    fn count_captured(&self) {
        let Some(c) = &self.capture else { return };
        let before = c
            .left
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        if before == Ok(1) {
            stop_capture(c);
        }
    }
}

fn stop_capture(c: &Capture) {
    // SAFETY: as in start_capture.
    let manager = unsafe { MTLCaptureManager::sharedCaptureManager() };
    if manager.isCapturing() {
        manager.stopCapture();
        eprintln!("lily: Metal GPU capture written to {}", c.path.display());
    }
}

impl Drop for Device {
    /// A capture still running (fewer command buffers than asked for) is stopped, so the trace
    /// is written.
    fn drop(&mut self) {
        if let Some(c) = &self.capture {
            if c.left.swap(0, Ordering::AcqRel) > 0 {
                autoreleasepool(|_| stop_capture(c));
            }
        }
    }
}
