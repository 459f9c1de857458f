//! The real Metal device (macOS, Apple silicon): the [`Executor`] that `Metal<Device>` drives.
//!
//! - Device: `MTLCreateSystemDefaultDevice`, accepted when it supports `MTLGPUFamilyApple7`
//!   (M1 and later: the kernels rely on Apple-GPU simdgroup operations and `bfloat`).
//! - Shaders: the sources embedded in `kernels.rs`, one library per `.metal` file with the
//!   headers inlined (`kernels::standalone`), compiled at construction with
//!   `newLibraryWithSource` (fast math on; `LILY_METAL_FAST_MATH=0` turns it off when hunting
//!   a parity bug). `Metal::new` then builds every pipeline, so a missing kernel fails there.
//! - Memory: every buffer is `StorageModeShared` (unified memory: the CPU reads and writes it
//!   through `contents`). Weights are wrapped in place with `newBufferWithBytesNoCopy` over
//!   the page-aligned region of the mapped checkpoint that covers the tensor; the tensor's
//!   offset inside that region goes to the kernel as the binding offset. Where that is not
//!   possible (offset not 4-byte aligned, region over `maxBufferLength`, wrapping refused)
//!   the tensor is copied once.
//! - Commands: one command buffer with one serial compute encoder per `Metal` command stream
//!   (a whole decode step), committed and waited for at `commit_wait`; its error, if any,
//!   comes back as `Error::Device` there.
//!
//! Thread safety: `MTLDevice`, `MTLCommandQueue`, `MTLLibrary` and pipeline states are
//! thread-safe (objc2-metal marks them `Send + Sync`). Buffers and command buffers are not
//! marked; the wrappers below assert `Send`/`Sync` with the reason at each `unsafe impl`.

use std::{
    ffi::{c_int, c_void},
    ptr::NonNull,
    sync::Arc,
};

use objc2::{
    rc::{autoreleasepool, Retained},
    runtime::ProtocolObject,
};
use objc2_foundation::{NSError, NSString};
use objc2_metal::{
    MTLBuffer, MTLCommandBuffer, MTLCommandBufferStatus, MTLCommandEncoder, MTLCommandQueue, MTLCompileOptions,
    MTLComputeCommandEncoder, MTLComputePipelineState, MTLCreateSystemDefaultDevice, MTLDevice, MTLGPUFamily,
    MTLLibrary, MTLResourceOptions, MTLSize,
};

use super::{
    executor::{Arg, Executor, Grid},
    kernels,
};
use crate::{
    error::{Error, Result},
    safetensors::Bytes,
};

extern "C" {
    /// libc (libSystem on macOS): the VM page size (16 KiB on Apple silicon).
    fn getpagesize() -> c_int;
}

/// The Metal device, its queue and the compiled shader libraries.
pub struct Device {
    device: Retained<ProtocolObject<dyn MTLDevice>>,
    queue: Retained<ProtocolObject<dyn MTLCommandQueue>>,
    libs: Vec<Retained<ProtocolObject<dyn MTLLibrary>>>,
    name: String,
    fast_math: bool,
    page: usize,
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

/// A compute pipeline and the largest threadgroup it accepts.
pub struct DevicePipeline {
    state: Retained<ProtocolObject<dyn MTLComputePipelineState>>,
    max_threads: usize,
}

/// One command buffer with its open compute encoder.
pub struct DeviceEncoder {
    cb: Retained<ProtocolObject<dyn MTLCommandBuffer>>,
    enc: Retained<ProtocolObject<dyn MTLComputeCommandEncoder>>,
    ended: bool,
    /// No-copy weight buffers bound so far: their mapping must outlive the GPU's use of it.
    keep: Vec<DeviceBuffer>,
    /// The first dispatch this device cannot run (reported by `commit_wait`).
    error: Option<Error>,
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
    /// An encoder dropped without `commit_wait` (an encoding error was reported instead) must
    /// still end encoding: Metal asserts on an encoder released while open.
    fn drop(&mut self) {
        self.end();
    }
}

fn ns_error(e: &NSError) -> String {
    e.localizedDescription().to_string()
}

impl Device {
    /// Open the default Metal device and compile every shader file.
    pub fn new() -> Result<Device> {
        autoreleasepool(|_| Self::open())
    }

    fn open() -> Result<Device> {
        let device = MTLCreateSystemDefaultDevice().ok_or_else(|| {
            Error::Device("no Metal device: MTLCreateSystemDefaultDevice returned nil (a VM or a headless runner without GPU access?)".into())
        })?;
        let name = device.name().to_string();
        if !device.supportsFamily(MTLGPUFamily::Apple7) {
            return Err(Error::Device(format!(
                "Metal device {name:?} is not in GPU family Apple7 or later (M1..M5): Lily's Metal kernels need Apple-silicon simdgroup operations and bfloat; use backend=\"cpu\""
            )));
        }
        let queue = device
            .newCommandQueue()
            .ok_or_else(|| Error::Device(format!("Metal device {name:?}: cannot create a command queue")))?;
        let fast_math = std::env::var("LILY_METAL_FAST_MATH").map_or(true, |v| v != "0");
        let opts = MTLCompileOptions::new();
        // setMathMode replaces this from macOS 15 only; fastMathEnabled works on every macOS.
        #[allow(deprecated)]
        opts.setFastMathEnabled(fast_math);
        let mut libs = Vec::new();
        for (file, src) in kernels::metal_files() {
            let source = NSString::from_str(&kernels::standalone(file, src));
            let lib = device
                .newLibraryWithSource_options_error(&source, Some(&opts))
                .map_err(|e| {
                    Error::Device(format!(
                        "Metal: shaders/metal/{file} does not compile: {}",
                        ns_error(&e)
                    ))
                })?;
            libs.push(lib);
        }
        // SAFETY: getpagesize has no preconditions.
        let page = usize::try_from(unsafe { getpagesize() }).unwrap_or(16384).max(4096);
        Ok(Device {
            device,
            queue,
            libs,
            name,
            fast_math,
            page,
        })
    }

    fn wrap(&self, buf: Option<Retained<ProtocolObject<dyn MTLBuffer>>>, bytes: usize) -> Result<DeviceBuffer> {
        let buf = buf.ok_or_else(|| {
            Error::Device(format!(
                "Metal: cannot allocate a buffer of {bytes} bytes on {} (out of memory or over maxBufferLength {})",
                self.name,
                self.device.maxBufferLength()
            ))
        })?;
        Ok(DeviceBuffer(Arc::new(BufferInner { buf, _keep: None })))
    }

    /// Wrap the page-aligned region covering `data` without copying: the buffer and the offset
    /// of `data` in it, or None where Metal cannot take that region as is.
    fn wrap_in_place(&self, data: &Bytes) -> Option<(DeviceBuffer, usize)> {
        let ptr = data.as_slice().as_ptr() as usize;
        // Weights are read as at most 4-byte elements (u32 codes, f32/f16/bf16 values).
        if data.is_empty() || ptr % 4 != 0 {
            return None;
        }
        // Every page holding a byte of a mapping is mapped whole, so the region rounded out to
        // page boundaries stays inside the checkpoint's mapping (file or anonymous).
        let start = ptr / self.page * self.page;
        let end = (ptr + data.len()).div_ceil(self.page) * self.page;
        if end - start > self.device.maxBufferLength() {
            return None;
        }
        let base = NonNull::new(start as *mut c_void)?;
        // SAFETY: [start, end) is mapped readable for as long as `data`'s mapping lives, and the
        // returned buffer keeps a clone of `data` (so the mapping) alive; kernels only read
        // weight buffers. No deallocator: the memory belongs to the mapping.
        let buf = unsafe {
            self.device.newBufferWithBytesNoCopy_length_options_deallocator(
                base,
                end - start,
                MTLResourceOptions::StorageModeShared,
                None,
            )
        }?;
        let inner = BufferInner {
            buf,
            _keep: Some(data.clone()),
        };
        Some((DeviceBuffer(Arc::new(inner)), ptr - start))
    }
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

    fn describe(&self) -> String {
        format!(
            "Metal on {} (fast math {})",
            self.name,
            if self.fast_math { "on" } else { "off" }
        )
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

    fn weight_buffer(&self, data: &Bytes) -> Result<(DeviceBuffer, usize)> {
        match self.wrap_in_place(data) {
            Some(b) => Ok(b),
            None => Ok((self.new_buffer_with(data.as_slice())?, 0)),
        }
    }

    fn contents(&self, b: &DeviceBuffer) -> *mut u8 {
        b.0.buf.contents().as_ptr() as *mut u8
    }

    fn pipeline(&self, name: &str) -> Result<DevicePipeline> {
        autoreleasepool(|_| self.build_pipeline(name))
    }

    fn encoder(&self) -> Result<DeviceEncoder> {
        autoreleasepool(|_| self.open_encoder())
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
        autoreleasepool(|_| self.encode(e, name, p, args, grid, tg_mem))
    }

    fn commit_wait(&self, e: DeviceEncoder) -> Result<()> {
        autoreleasepool(|_| self.submit(e))
    }
}

/// The bodies of the `Executor` methods, each run inside an autorelease pool: Metal returns
/// command buffers, encoders and errors autoreleased, and without a pool per call they would
/// pile up for the life of the thread (a leak per decode step on a long-running thread).
impl Device {
    fn build_pipeline(&self, name: &str) -> Result<DevicePipeline> {
        let ns = NSString::from_str(name);
        let Some(f) = self.libs.iter().find_map(|l| l.newFunctionWithName(&ns)) else {
            return Err(Error::Device(format!(
                "Metal: no kernel named {name:?} in the compiled shaders"
            )));
        };
        let state = self
            .device
            .newComputePipelineStateWithFunction_error(&f)
            .map_err(|e| Error::Device(format!("Metal: pipeline {name}: {}", ns_error(&e))))?;
        let max_threads = state.maxTotalThreadsPerThreadgroup();
        Ok(DevicePipeline { state, max_threads })
    }

    fn open_encoder(&self) -> Result<DeviceEncoder> {
        let cb = self
            .queue
            .commandBuffer()
            .ok_or_else(|| Error::Device("Metal: cannot create a command buffer".into()))?;
        let enc = cb
            .computeCommandEncoder()
            .ok_or_else(|| Error::Device("Metal: cannot create a compute encoder".into()))?;
        Ok(DeviceEncoder {
            cb,
            enc,
            ended: false,
            keep: Vec::new(),
            error: None,
        })
    }

    fn encode(
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
                p.max_threads, self.name
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
        e.enc.setComputePipelineState(&p.state);
        for (i, a) in args.iter().enumerate() {
            match a {
                Arg::Bytes(b) => {
                    let Some(ptr) = NonNull::new(b.as_ptr() as *mut c_void) else {
                        continue;
                    };
                    // SAFETY: `b` holds b.len() bytes (a parameter struct, under setBytes' 4 KiB
                    // limit); Metal copies them into the command buffer before returning.
                    unsafe { e.enc.setBytes_length_atIndex(ptr, b.len(), i) };
                }
                Arg::Buf(b, off, len) => {
                    if *off + *len > b.0.buf.length() {
                        e.error = Some(Error::Device(format!(
                            "Metal: {name}: binding {len} bytes at offset {off} of a {}-byte buffer",
                            b.0.buf.length()
                        )));
                        return;
                    }
                    // SAFETY: a live buffer of this device; the binding lies inside it (checked).
                    unsafe { e.enc.setBuffer_offset_atIndex(Some(&b.0.buf), *off, i) };
                    if b.0._keep.is_some() {
                        e.keep.push((*b).clone());
                    }
                }
            }
        }
        for (i, &bytes) in tg_mem.iter().enumerate() {
            // SAFETY: a length rounded up to 16 bytes (Metal's rule) for `[[threadgroup(i)]]`;
            // the kernels need at most a few KiB, under every Apple7+ GPU's 32 KiB.
            unsafe { e.enc.setThreadgroupMemoryLength_atIndex(bytes.div_ceil(16) * 16, i) };
        }
        match grid {
            Grid::Groups { count, size: s } => e.enc.dispatchThreadgroups_threadsPerThreadgroup(size(count), size(s)),
            Grid::Threads { threads, size: s } => e.enc.dispatchThreads_threadsPerThreadgroup(size(threads), size(s)),
        }
    }

    fn submit(&self, mut e: DeviceEncoder) -> Result<()> {
        e.end();
        if let Some(err) = e.error.take() {
            return Err(err);
        }
        e.cb.commit();
        e.cb.waitUntilCompleted();
        if e.cb.status() == MTLCommandBufferStatus::Error {
            let why =
                e.cb.error()
                    .map_or_else(|| "unknown error".to_string(), |err| ns_error(&err));
            return Err(Error::Device(format!(
                "Metal command buffer failed on {}: {why}",
                self.name
            )));
        }
        Ok(())
    }
}
