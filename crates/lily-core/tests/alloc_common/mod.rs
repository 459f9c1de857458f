//! The shared harness of the allocation tests (`cuda_alloc.rs`, `metal_alloc.rs`, `cpu_alloc.rs`,
//! `cpu_simd.rs`): a counting global allocator that forwards to the system allocator and counts
//! this thread's allocations while armed, so a test asserts what its own thread allocates (the
//! test harness allocates on its own threads; a test crate that declares this module gets it as
//! its `#[global_allocator]`), and every thread's (the CPU backend's pool threads allocate for the
//! caller: `all_allocations`, for test binaries that run one test at a time); and the prefill
//! chunk and decode step that the tests encode warm on any backend.

#![allow(dead_code)] // each test binary uses the subset it needs

use std::{
    alloc::{GlobalAlloc, Layout, System},
    cell::Cell,
    sync::atomic::{AtomicUsize, Ordering},
};

use lily_core::{
    backend::{Backend, StreamKind},
    model::{
        state::{Scratch, State},
        Model,
    },
};

struct Counting;

thread_local! {
    /// Whether this thread's allocations are being counted.
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static COUNT: Cell<usize> = const { Cell::new(0) };
}

/// Every thread's allocations since the process started.
static ALL: AtomicUsize = AtomicUsize::new(0);

fn note() {
    ALL.fetch_add(1, Ordering::Relaxed);
    if ARMED.try_with(Cell::get).unwrap_or(false) {
        let _ = COUNT.try_with(|c| c.set(c.get() + 1));
    }
}

// SAFETY: forwards to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        note();
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        note();
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        note();
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The allocations (alloc, alloc_zeroed, realloc) of every thread so far: a test that runs alone
/// in its binary takes the difference around what it checks.
pub fn all_allocations() -> usize {
    ALL.load(Ordering::SeqCst)
}

/// The allocations (alloc, alloc_zeroed, realloc) this thread makes while `f` runs.
pub fn allocations_in<R>(f: impl FnOnce() -> R) -> (usize, R) {
    COUNT.with(|c| c.set(0));
    ARMED.with(|a| a.set(true));
    let r = f();
    ARMED.with(|a| a.set(false));
    (COUNT.with(Cell::get), r)
}

/// One prefill chunk of `prompt` from position 0, its last 16 rows of logits read back into
/// `logits`.
pub fn prefill<B: Backend>(
    b: &B,
    model: &Model<B>,
    prompt: &[u32],
    s: &mut Scratch<B>,
    state: &mut State<B>,
    logits: &mut [f32],
) {
    b.begin(StreamKind::Prefill).unwrap();
    b.write_ids(&mut s.ids, prompt).unwrap();
    model.forward(b, prompt.len(), 0, state, s);
    model.logits(b, prompt.len() - 16, 16, s);
    b.finish().unwrap();
    b.read(&s.logits, 0, logits).unwrap();
}

/// One decode step of token `tok` at position `pos`, the last of its `vocab` logits read back.
pub fn decode_step<B: Backend>(
    b: &B,
    model: &Model<B>,
    (tok, pos): (u32, usize),
    vocab: usize,
    s: &mut Scratch<B>,
    state: &mut State<B>,
) {
    let mut one = [0f32; 1];
    b.begin(StreamKind::Decode).unwrap();
    b.write_ids(&mut s.ids, &[tok]).unwrap();
    model.forward(b, 1, pos, state, s);
    model.logits(b, 0, 1, s);
    b.finish().unwrap();
    b.read(&s.logits, vocab - 1, &mut one).unwrap();
}
