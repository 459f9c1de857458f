//! What a Metal executor must provide. The encoder logic (`mod.rs`: which kernel, which
//! bindings, grid and threadgroup sizes, buffer plan) is written once against this trait and
//! drives two executors: the real Metal device (`device.rs`, Apple targets) and the simulator
//! (`sim.rs`, which runs the same `.metal` sources on the CPU through tools/metal-sim).
//!
//! Memory model: every buffer is CPU-visible (shared storage on Apple Silicon's unified memory,
//! host memory in the simulator). Dispatches of one command stream run in encoding order, each
//! seeing the writes of the previous ones (a serial compute encoder).

pub use super::args::ParamBytes;
use crate::error::{Error, Result};

/// The Apple GPU family a Metal device supports (`MTLGPUFamilyApple7` and later: every Apple
/// silicon Mac, whose simdgroup operations and simdgroup matrices Lily's kernels need). Every
/// kernel variant runs on every family; the family only picks the fastest ones
/// (`kernels::Variants::for_family`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GpuFamily {
    /// M1 (and A14).
    Apple7,
    /// M2 (and A15, A16).
    Apple8,
    /// M3 and M4 (and A17 Pro, A18): dynamic caching (registers and threadgroup memory allocated
    /// as the shader runs, not reserved for the worst case at launch).
    Apple9,
    /// M5 (and A19).
    Apple10,
}

impl GpuFamily {
    /// Oldest first.
    pub const ALL: [GpuFamily; 4] = [
        GpuFamily::Apple7,
        GpuFamily::Apple8,
        GpuFamily::Apple9,
        GpuFamily::Apple10,
    ];
    /// What the simulator reports unless told otherwise.
    pub const NEWEST: GpuFamily = GpuFamily::Apple10;

    /// The number N of `MTLGPUFamilyAppleN`.
    pub fn number(self) -> u32 {
        match self {
            GpuFamily::Apple7 => 7,
            GpuFamily::Apple8 => 8,
            GpuFamily::Apple9 => 9,
            GpuFamily::Apple10 => 10,
        }
    }

    pub fn from_number(n: u32) -> Option<GpuFamily> {
        GpuFamily::ALL.into_iter().find(|f| f.number() == n)
    }

    /// The Mac chips of the family.
    pub fn chips(self) -> &'static str {
        match self {
            GpuFamily::Apple7 => "M1",
            GpuFamily::Apple8 => "M2",
            GpuFamily::Apple9 => "M3/M4",
            GpuFamily::Apple10 => "M5",
        }
    }

    /// `LILY_METAL_FAMILY` (7, 8, 9 or 10; `Apple9` is accepted too): the family whose kernel
    /// variants to use, read when a Metal executor is created. `None` when unset or empty.
    pub fn from_env() -> Result<Option<GpuFamily>> {
        let Ok(v) = std::env::var("LILY_METAL_FAMILY") else {
            return Ok(None);
        };
        if v.trim().is_empty() {
            return Ok(None);
        }
        GpuFamily::parse(&v).map(Some)
    }

    /// "7" .. "10" or "Apple7" .. "Apple10".
    pub fn parse(v: &str) -> Result<GpuFamily> {
        let t = v.trim();
        let n = t.strip_prefix("Apple").or_else(|| t.strip_prefix("apple")).unwrap_or(t);
        n.parse().ok().and_then(GpuFamily::from_number).ok_or_else(|| {
            Error::Device(format!(
                "LILY_METAL_FAMILY must be 7, 8, 9 or 10 (GPU family Apple7 = M1 .. Apple10 = M5), found {v:?}"
            ))
        })
    }
}

impl std::fmt::Display for GpuFamily {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Apple{} ({})", self.number(), self.chips())
    }
}

/// A Metal GPU as `lily info` reports it and the memory check at load sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// `MTLDevice.name` ("Apple M3 Max").
    pub name: String,
    /// The newest Apple GPU family it supports.
    pub family: GpuFamily,
    /// `recommendedMaxWorkingSetSize`: bytes the GPU can use without hurting performance (about
    /// two thirds to three quarters of the Mac's memory); weights, state and KV cache must fit.
    pub working_set: u64,
    /// `hasUnifiedMemory`: CPU and GPU share memory (every Apple silicon Mac).
    pub unified_memory: bool,
    /// `maxBufferLength`: the largest single buffer.
    pub max_buffer_length: u64,
}

/// A weight tensor placed on the device: its buffer, the tensor's byte offset in it, and
/// whether its bytes had to be copied (the mapped checkpoint could not be wrapped in place).
pub struct Placed<B> {
    pub buf: B,
    pub offset: usize,
    pub copied: bool,
}

/// What a command stream runs: the device labels its command buffer and compute encoder with
/// it, so an Xcode GPU capture reads "lily step 12" / "lily prefill chunk" rather than
/// "Command Buffer 0x...". The backend sets it from the engine's `Backend::begin(StreamKind)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamLabel {
    /// A one-token forward pass: decode step `n` of this backend (counted from 1).
    Step(u64),
    /// A forward pass over several tokens.
    PrefillChunk,
    /// Anything else (logits of earlier prefill rows, single kernels in tests).
    Commands,
}

impl StreamLabel {
    /// The compute encoder's label (static: no allocation).
    pub fn encoder(self) -> &'static str {
        match self {
            StreamLabel::Step(_) => "lily decode",
            StreamLabel::PrefillChunk => "lily prefill",
            StreamLabel::Commands => "lily commands",
        }
    }
}

impl std::fmt::Display for StreamLabel {
    /// The command buffer's label.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StreamLabel::Step(n) => write!(f, "lily step {n}"),
            StreamLabel::PrefillChunk => f.write_str("lily prefill chunk"),
            StreamLabel::Commands => f.write_str("lily commands"),
        }
    }
}

/// One `[[buffer(i)]]` binding, in slot order. Building one allocates nothing.
pub enum Arg<'a, B> {
    /// A small parameter struct copied into the command stream (`setBytes`), held inline.
    Bytes(ParamBytes),
    /// `len` bytes of a buffer starting at `offset` (`setBuffer:offset:`).
    Buf(&'a B, usize, usize),
}

/// The launch shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grid {
    /// `dispatchThreadgroups(count, size)`.
    Groups { count: [u32; 3], size: [u32; 3] },
    /// `dispatchThreads(threads, size)`: the edge threadgroups are partial.
    Threads { threads: [u32; 3], size: [u32; 3] },
}

pub trait Executor: Send + Sized + 'static {
    /// The backend name the engine reports ("metal", "metal-sim").
    const NAME: &'static str;
    /// A retained handle to a buffer; clones share it.
    type Buffer: Clone + Send + Sync;
    /// A compiled kernel.
    type Pipeline: Send + Sync;
    /// An open command stream (command buffer + compute encoder).
    type Encoder: Send;
    /// A committed command stream not waited for yet.
    type Pending: Send;

    /// What runs the kernels, in words.
    fn describe(&self) -> String;
    /// The GPU family whose kernel variants the backend uses: the newest `MTLGPUFamilyAppleN`
    /// the device supports (or `LILY_METAL_FAMILY`); in the simulator, the family chosen at
    /// construction.
    fn family(&self) -> GpuFamily;
    /// A zeroed, CPU-visible buffer of `bytes` bytes.
    fn new_buffer(&self, bytes: usize) -> Result<Self::Buffer>;
    /// A buffer holding a copy of `data`.
    fn new_buffer_with(&self, data: &[u8]) -> Result<Self::Buffer> {
        let b = self.new_buffer(data.len())?;
        // SAFETY: the buffer was just created with data.len() bytes and nothing else uses it yet.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.contents(&b), data.len()) };
        Ok(b)
    }
    /// A buffer over the weight bytes `data` (a range of the mapped checkpoint, kept alive by the
    /// buffer): wrapped without a copy where the device allows it ([`wrappable`]), else copied.
    fn weight_buffer(&self, data: &crate::safetensors::Bytes) -> Result<Placed<Self::Buffer>> {
        Ok(Placed {
            buf: self.new_buffer_with(data.as_slice())?,
            offset: 0,
            copied: true,
        })
    }
    /// The memory the backend's buffers should stay within: the GPU's
    /// `recommendedMaxWorkingSetSize` (the simulator: `LILY_METAL_SIM_WORKING_SET`, for tests);
    /// `None`: no limit known.
    fn working_set(&self) -> Option<u64> {
        None
    }
    /// The CPU address of a buffer's first byte.
    fn contents(&self, b: &Self::Buffer) -> *mut u8;
    /// The GPU address of a buffer's first byte, as a kernel reads it from a table of addresses
    /// (Metal 3's `gpuAddress`; the simulator's buffers are host memory, so there it is the
    /// CPU address).
    fn gpu_address(&self, b: &Self::Buffer) -> u64;
    /// Make `bufs` resident for the dispatches encoded next: buffers a kernel reaches only
    /// through addresses in another buffer (`useResource` on the device; nothing in the
    /// simulator, where every buffer is host memory).
    fn use_resources(&self, _enc: &mut Self::Encoder, _bufs: &[Self::Buffer]) {}
    /// The kernel with host name `name`, compiled at construction.
    fn pipeline(&self, name: &str) -> Result<Self::Pipeline>;
    /// Open a command stream; `label` names it in GPU captures.
    fn encoder(&self, label: StreamLabel) -> Result<Self::Encoder>;
    /// Encode one dispatch of kernel `name` (the device wraps it in a debug group of that name).
    /// Called for every kernel of every decode step: an executor should not allocate here once
    /// warm (the device does not; the simulator, test tooling, records the dispatch).
    fn dispatch(
        &self,
        enc: &mut Self::Encoder,
        name: &str,
        pipeline: &Self::Pipeline,
        args: &[Arg<'_, Self::Buffer>],
        grid: Grid,
        tg_mem: &[usize],
    );
    /// Submit a command stream (the GPU starts on it while the host goes on); its errors surface
    /// at [`Executor::wait`]. Streams run in the order they are committed.
    fn commit(&self, enc: Self::Encoder) -> Result<Self::Pending>;
    /// Wait for a committed stream to complete; its errors surface here.
    fn wait(&self, done: Self::Pending) -> Result<()>;
    /// Submit and wait.
    fn commit_wait(&self, enc: Self::Encoder) -> Result<()> {
        let p = self.commit(enc)?;
        self.wait(p)
    }
}

/// Where a weight tensor at host address `ptr` of `len` bytes can be wrapped in place: the
/// region rounded out to whole pages of `page` bytes (every page holding a byte of a mapping is
/// mapped whole, so it stays inside the checkpoint's mapping), and the tensor's offset in it.
/// `None` when the kernels could not read it there (not 4-byte aligned: weights are read as u32
/// codes and 2- and 4-byte floats) or the region is longer than `max_len` (the device's
/// `maxBufferLength`). The one rule of the device and the simulator, so the copied bytes the
/// simulator counts are the ones a Mac would copy.
pub fn wrappable(ptr: usize, len: usize, page: usize, max_len: usize) -> Option<(usize, usize, usize)> {
    if len == 0 || ptr % 4 != 0 {
        return None;
    }
    let start = ptr / page * page;
    let end = (ptr + len).div_ceil(page) * page;
    (end - start <= max_len).then_some((start, end - start, ptr - start))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_parse_and_print() {
        for f in GpuFamily::ALL {
            assert_eq!(GpuFamily::parse(&f.number().to_string()).unwrap(), f);
            assert_eq!(GpuFamily::parse(&format!("Apple{}", f.number())).unwrap(), f);
        }
        assert_eq!(GpuFamily::parse(" 9 ").unwrap().to_string(), "Apple9 (M3/M4)");
        for bad in ["6", "11", "M1", ""] {
            let e = GpuFamily::parse(bad).unwrap_err().to_string();
            assert!(e.contains("LILY_METAL_FAMILY"), "{e}");
        }
        assert!(GpuFamily::ALL.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(GpuFamily::NEWEST, *GpuFamily::ALL.last().unwrap());
    }

    #[test]
    fn weights_are_wrapped_where_the_kernels_can_read_them() {
        // A tensor at byte 4100 of a page-aligned mapping: the region from its page, offset 4.
        assert_eq!(wrappable(0x10000 + 4100, 50, 4096, 1 << 30), Some((0x11000, 4096, 4)));
        // Spanning a page boundary: both pages.
        assert_eq!(
            wrappable(0x10000 + 4092, 10, 4096, 1 << 30),
            Some((0x10000, 8192, 4092))
        );
        // Not 4-byte aligned, empty, or a region past the largest buffer: copied.
        assert_eq!(wrappable(0x10000 + 4098, 50, 4096, 1 << 30), None);
        assert_eq!(wrappable(0x10000, 0, 4096, 1 << 30), None);
        assert_eq!(wrappable(0x10000, 8193, 4096, 8192), None);
        assert_eq!(wrappable(0x10000, 8192, 4096, 8192), Some((0x10000, 8192, 0)));
    }

    #[test]
    fn stream_labels() {
        assert_eq!(StreamLabel::Step(12).to_string(), "lily step 12");
        assert_eq!(StreamLabel::PrefillChunk.to_string(), "lily prefill chunk");
        assert_eq!(StreamLabel::Step(1).encoder(), "lily decode");
    }
}
