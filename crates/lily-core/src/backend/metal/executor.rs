//! What a Metal executor must provide. The encoder logic (`mod.rs`: which kernel, which
//! bindings, grid and threadgroup sizes, buffer plan) is written once against this trait and
//! drives two executors: the real Metal device (`device.rs`, Apple targets) and the simulator
//! (`sim.rs`, which runs the same `.metal` sources on the CPU through tools/metal-sim).
//!
//! Memory model: every buffer is CPU-visible (shared storage on Apple Silicon's unified memory,
//! host memory in the simulator). Dispatches of one command stream run in encoding order, each
//! seeing the writes of the previous ones (a serial compute encoder).

use crate::error::Result;

/// One `[[buffer(i)]]` binding, in slot order.
pub enum Arg<'a, B> {
    /// A small parameter struct copied into the command stream (`setBytes`).
    Bytes(Vec<u8>),
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

    /// What runs the kernels, in words.
    fn describe(&self) -> String;
    /// A zeroed, CPU-visible buffer of `bytes` bytes.
    fn new_buffer(&self, bytes: usize) -> Result<Self::Buffer>;
    /// A buffer holding a copy of `data`.
    fn new_buffer_with(&self, data: &[u8]) -> Result<Self::Buffer> {
        let b = self.new_buffer(data.len())?;
        // SAFETY: the buffer was just created with data.len() bytes and nothing else uses it yet.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.contents(&b), data.len()) };
        Ok(b)
    }
    /// A buffer over the weight bytes `data`, which stay alive in `keep` (the mapped checkpoint):
    /// wrapped without a copy where the device allows it; the offset of `data` inside the buffer.
    fn weight_buffer(&self, data: &crate::safetensors::Bytes) -> Result<(Self::Buffer, usize)> {
        Ok((self.new_buffer_with(data.as_slice())?, 0))
    }
    /// The CPU address of a buffer's first byte.
    fn contents(&self, b: &Self::Buffer) -> *mut u8;
    /// The kernel with host name `name`, compiled at construction.
    fn pipeline(&self, name: &str) -> Result<Self::Pipeline>;
    fn encoder(&self) -> Result<Self::Encoder>;
    fn dispatch(
        &self,
        enc: &mut Self::Encoder,
        name: &str,
        pipeline: &Self::Pipeline,
        args: &[Arg<'_, Self::Buffer>],
        grid: Grid,
        tg_mem: &[usize],
    );
    /// Submit and wait; errors of the command stream surface here.
    fn commit_wait(&self, enc: Self::Encoder) -> Result<()>;
}
