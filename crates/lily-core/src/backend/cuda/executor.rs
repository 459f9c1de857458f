//! What a CUDA executor must provide. The encoding layer (`mod.rs`: which kernel, which
//! arguments, grid and block, buffer plan, decode graphs) is written once against this trait and
//! drives three executors: the real GPU (`device.rs`: the driver API through cudarc, kernels
//! compiled by NVRTC), the simulator (`sim.rs`: the same `.cu` sources run on the CPU through
//! tools/cuda-sim) and [`Null`] (records launches, runs nothing: host-code tests in CI).
//!
//! Memory model: device memory is addressed by [`DevPtr`]; `write` / `read` copy synchronously
//! with respect to the host (a `read` waits for the work launched before it); launches, zeroing
//! and device copies run in issue order on one stream.

use std::sync::Mutex;

pub use super::args::{Args, DevPtr};
use crate::error::{Error, Result};

/// A launch shape: `grid` blocks of `block` threads, `shared` bytes of dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared: u32,
}

/// Whether kernels should be launched with programmatic dependent launch (the launch attribute
/// `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`): on compute capability 9.0 or newer
/// (`arch` = major * 10 + minor), with a driver of CUDA 12.3 or newer (`driver` as
/// `cuDriverGetVersion` reports it: programmatic edges in captured graphs), unless `setting` (the
/// value of `LILY_CUDA_PDL`) is "0", the off switch.
pub fn programmatic_launch(arch: u32, driver: i32, setting: Option<&str>) -> bool {
    arch >= 90 && driver >= 12030 && setting.is_none_or(|v| v.trim() != "0")
}

pub trait Executor: Send + Sync + Sized + 'static {
    /// The backend name the engine reports ("cuda", "cuda-sim", "cuda-null").
    const NAME: &'static str;
    /// A loaded kernel.
    type Function: Send + Sync;
    /// A captured, instantiated command sequence (a CUDA graph) replayable with `graph_launch`.
    type Graph: Send;

    /// What runs the kernels, in words.
    fn describe(&self) -> String;
    /// A zeroed device buffer of `bytes` bytes; `label` names it in simulator messages.
    fn alloc(&self, bytes: usize, label: &str) -> Result<DevPtr>;
    /// Give back a buffer from `alloc` (errors are ignored: nothing can be done about them).
    fn free(&self, p: DevPtr);
    /// Copy host bytes to the device (returns when the copy is done).
    fn write(&self, dst: DevPtr, data: &[u8]) -> Result<()>;
    /// Copy device bytes to the host after the work launched so far.
    fn read(&self, src: DevPtr, out: &mut [u8]) -> Result<()>;
    /// Zero `bytes` bytes at `dst` (in stream order).
    fn zero(&self, dst: DevPtr, bytes: usize) -> Result<()>;
    /// Copy `bytes` bytes between device buffers (in stream order).
    fn copy(&self, src: DevPtr, dst: DevPtr, bytes: usize) -> Result<()>;
    /// The kernel named `name` (loaded at construction).
    fn function(&self, name: &str) -> Result<Self::Function>;
    /// Launch `f` (named `name` in messages) with `args`, in stream order. Called for every
    /// kernel of every eagerly run step: it should not allocate once warm.
    fn launch(&self, f: &Self::Function, name: &str, shape: Launch, args: &mut Args) -> Result<()>;
    /// Wait for everything launched; errors of the work surface here.
    fn sync(&self) -> Result<()>;
    /// Start recording the launches that follow into a graph instead of running them; `false`
    /// when this executor has no graphs (the commands then run as they are launched).
    /// `programmatic`: launch the captured kernels with programmatic dependent launch where the
    /// executor has it (the backend asks for it for decode steps only).
    fn capture_begin(&self, programmatic: bool) -> Result<bool> {
        let _ = programmatic;
        Ok(false)
    }
    /// End the recording begun by `capture_begin` and instantiate it.
    fn capture_end(&self) -> Result<Self::Graph> {
        Err(Error::Device("this executor has no graphs".into()))
    }
    /// Run a captured graph, in stream order.
    fn graph_launch(&self, g: &Self::Graph) -> Result<()> {
        let _ = g;
        Err(Error::Device("this executor has no graphs".into()))
    }
    /// Bytes of device memory in use by this process's allocations (peak since construction),
    /// where the executor knows it.
    fn peak_bytes(&self) -> Option<usize> {
        None
    }
    /// Start the peak over from the memory in use now (after a measurement's temporary buffers).
    fn reset_peak(&self) {}
}

/// One launch the [`Null`] executor saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recorded {
    pub name: String,
    pub shape: Launch,
    pub args: usize,
}

/// Records launches and runs nothing: device "memory" is a counter of addresses, reads return
/// zeros. For host-code tests (the command stream, argument checks, graph reuse, allocations in
/// the encoding layer) on machines without a GPU or a compiler. `record` keeps every launch
/// (tests of the launch sequence); off, launches are only counted (allocation tests).
#[derive(Default)]
pub struct Null {
    next: Mutex<u64>,
    pub record: bool,
    log: Mutex<Vec<Recorded>>,
    launches: std::sync::atomic::AtomicUsize,
    graphs: std::sync::atomic::AtomicUsize,
    programmatic: std::sync::atomic::AtomicUsize,
    replays: std::sync::atomic::AtomicUsize,
}

impl Null {
    pub fn new(record: bool) -> Null {
        Null {
            next: Mutex::new(0x1000),
            record,
            ..Default::default()
        }
    }
    /// Launches recorded since the last call (with `record`).
    pub fn take_log(&self) -> Vec<Recorded> {
        std::mem::take(&mut *self.log.lock().unwrap_or_else(|e| e.into_inner()))
    }
    /// Graphs captured with programmatic dependent launch asked for, so far.
    pub fn programmatic_captures(&self) -> usize {
        self.programmatic.load(std::sync::atomic::Ordering::Relaxed)
    }
    /// (eager launches, graphs captured, graph replays) so far.
    pub fn counts(&self) -> (usize, usize, usize) {
        use std::sync::atomic::Ordering::Relaxed;
        (
            self.launches.load(Relaxed),
            self.graphs.load(Relaxed),
            self.replays.load(Relaxed),
        )
    }
}

impl Executor for Null {
    const NAME: &'static str = "cuda-null";
    type Function = u16;
    type Graph = ();

    fn describe(&self) -> String {
        "CUDA null executor (records launches, runs nothing)".into()
    }
    fn alloc(&self, bytes: usize, _label: &str) -> Result<DevPtr> {
        let mut n = self.next.lock().unwrap_or_else(|e| e.into_inner());
        let p = *n;
        *n += (bytes as u64).next_multiple_of(256).max(256);
        Ok(p)
    }
    fn free(&self, _p: DevPtr) {}
    fn write(&self, _dst: DevPtr, _data: &[u8]) -> Result<()> {
        Ok(())
    }
    fn read(&self, _src: DevPtr, out: &mut [u8]) -> Result<()> {
        out.fill(0);
        Ok(())
    }
    fn zero(&self, _dst: DevPtr, _bytes: usize) -> Result<()> {
        Ok(())
    }
    fn copy(&self, _src: DevPtr, _dst: DevPtr, _bytes: usize) -> Result<()> {
        Ok(())
    }
    fn function(&self, _name: &str) -> Result<u16> {
        Ok(0)
    }
    fn launch(&self, _f: &u16, name: &str, shape: Launch, args: &mut Args) -> Result<()> {
        let threads = shape.block.iter().product::<u32>();
        if threads == 0 || threads > 1024 || shape.grid.contains(&0) || shape.grid[1] > 65535 || shape.grid[2] > 65535 {
            return Err(Error::Device(format!("{name}: invalid launch {shape:?}")));
        }
        self.launches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if self.record {
            self.log.lock().unwrap_or_else(|e| e.into_inner()).push(Recorded {
                name: name.to_string(),
                shape,
                args: args.len(),
            });
        }
        Ok(())
    }
    fn sync(&self) -> Result<()> {
        Ok(())
    }
    fn capture_begin(&self, programmatic: bool) -> Result<bool> {
        self.graphs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.programmatic
            .fetch_add(programmatic as usize, std::sync::atomic::Ordering::Relaxed);
        Ok(true)
    }
    fn capture_end(&self) -> Result<()> {
        Ok(())
    }
    fn graph_launch(&self, _g: &()) -> Result<()> {
        self.replays.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::programmatic_launch;

    #[test]
    fn programmatic_launch_needs_hopper_a_recent_driver_and_no_off_switch() {
        assert!(programmatic_launch(90, 13000, None));
        assert!(programmatic_launch(100, 12030, Some("1")));
        assert!(programmatic_launch(90, 13000, Some("")));
        assert!(!programmatic_launch(90, 13000, Some("0")));
        assert!(!programmatic_launch(90, 13000, Some(" 0 ")));
        assert!(!programmatic_launch(89, 13000, None));
        assert!(!programmatic_launch(80, 13000, None));
        assert!(!programmatic_launch(90, 12020, None));
    }
}
