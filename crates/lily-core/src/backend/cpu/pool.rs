//! The CPU thread pool: one thread per core (the caller plus `threads() - 1` workers, created
//! once), running the parallel loops of the kernels as numbered tasks.
//!
//! Why not a general work-stealing pool: a decode step is ~60 parallel loops of 5-500 us with
//! short serial stretches between them (norms, routing, x quantization). A worker that goes to
//! sleep in such a gap (rayon's do after ~10 us idle) costs a futex wake-up at the next loop,
//! measured at ~40 us on this machine's virtual cores: the caller then runs most of a small GEMV
//! alone. Here the workers busy-wait for the next loop for as long as a forward call lasts
//! ([`run`], a *session*) and a short grace period after it, and sleep on a condition variable
//! otherwise, so an idle engine costs no CPU.
//!
//! A loop ([`for_each`]) is published as one atomic word, `epoch:24 | n:20 | next:20`: every
//! thread claims task `next` by compare-and-swap (so a task number is never handed out for a
//! stale loop), runs it, and counts it done; the caller takes tasks too, then waits until all `n`
//! are done. Nothing is allocated per loop or per session.

use std::{
    any::Any,
    cell::{Cell, UnsafeCell},
    panic::{catch_unwind, resume_unwind, AssertUnwindSafe},
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*},
        Condvar, Mutex, MutexGuard, OnceLock,
    },
    thread,
    time::{Duration, Instant},
};

/// How long workers keep spinning after a session ends: a generation loop's steps are separated
/// by sampling and Python code (tens of us to a few ms), which should not pay a wake-up each.
const GRACE: Duration = Duration::from_millis(5);
/// Spins between clock reads / `yield_now` calls while waiting.
const SPINS: u32 = 256;
const FIELD: u32 = 20;
const MASK: u64 = (1 << FIELD) - 1;

type Task = dyn Fn(usize) + Sync;

struct Pool {
    /// Threads that run tasks: the caller and the workers started.
    threads: AtomicUsize,
    /// epoch | n | next, see the module comment.
    word: AtomicU64,
    /// The current loop's body; written by the driver only while no task of the previous loop
    /// can be claimed or running (all `n` done), read by a worker only after it claimed a task.
    task: UnsafeCell<*const Task>,
    done: AtomicUsize,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// A session is in progress (workers spin).
    active: AtomicBool,
    sleep: Mutex<()>,
    wake: Condvar,
    /// One driver at a time: a session holds it, so two threads' forward calls take turns.
    driver: Mutex<()>,
}

// SAFETY: `task` is only accessed under the protocol described on the field.
unsafe impl Sync for Pool {}

thread_local! {
    /// This thread drives the current session.
    static DRIVING: Cell<bool> = const { Cell::new(false) };
    /// This thread is running a task: a loop inside it runs serially.
    static IN_TASK: Cell<bool> = const { Cell::new(false) };
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<&'static Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let threads = std::env::var("LILY_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| thread::available_parallelism().map_or(1, |n| n.get()));
        let p: &'static Pool = Box::leak(Box::new(Pool {
            threads: AtomicUsize::new(1),
            word: AtomicU64::new(0),
            task: UnsafeCell::new(&(|_| {}) as &Task),
            done: AtomicUsize::new(0),
            panic: Mutex::new(None),
            active: AtomicBool::new(false),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
            driver: Mutex::new(()),
        }));
        for i in 1..threads {
            let spawned = thread::Builder::new()
                .name(format!("lily-cpu-{i}"))
                .spawn(move || worker(p));
            if spawned.is_err() {
                break; // run with the threads we have
            }
            p.threads.store(i + 1, Relaxed);
        }
        p
    })
}

/// Threads that run a loop's tasks (the caller included).
pub fn threads() -> usize {
    pool().threads.load(Relaxed)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `f` as one session: the workers busy-wait for its loops instead of sleeping between
/// them. Nested calls (and calls from inside a task) just run `f`. Another thread's session
/// waits for this one to end.
pub fn run<R>(f: impl FnOnce() -> R) -> R {
    if DRIVING.get() || IN_TASK.get() {
        return f();
    }
    let p = pool();
    let _turn = lock(&p.driver);
    struct End(&'static Pool);
    impl Drop for End {
        fn drop(&mut self) {
            self.0.active.store(false, Release);
            DRIVING.set(false);
        }
    }
    DRIVING.set(true);
    let _end = End(p);
    if !p.active.swap(true, AcqRel) {
        let _g = lock(&p.sleep);
        p.wake.notify_all();
    }
    f()
}

/// Runs `task(i)` for every i in 0..n on the pool (the caller takes part) and returns when all
/// are done. Order and thread of each task are unspecified. Outside a session this opens one
/// for the loop; inside a task it runs the loop serially. A panicking task is re-raised here
/// after every other task has finished.
pub fn for_each(n: usize, task: impl Fn(usize) + Sync) {
    let p = pool();
    if n <= 1 || p.threads.load(Relaxed) == 1 || IN_TASK.get() {
        (0..n).for_each(task);
        return;
    }
    if !DRIVING.get() {
        return run(|| for_each(n, task));
    }
    // More tasks than the word counts (no kernel gets near): consecutive loops.
    for base in (0..n).step_by(MASK as usize) {
        publish(p, (n - base).min(MASK as usize), &|i| task(base + i));
    }
}

/// Runs one loop of n <= MASK tasks from the session's driver; see [`for_each`].
fn publish(p: &Pool, n: usize, body: &(dyn Fn(usize) + Sync + '_)) {
    // SAFETY: every task of the previous loop is done (we waited), so no worker reads `task`;
    // the lifetime is erased, but this function returns only after all n tasks are done.
    unsafe { *p.task.get() = std::mem::transmute::<&(dyn Fn(usize) + Sync + '_), *const Task>(body) };
    p.done.store(0, Relaxed);
    let epoch = (p.word.load(Relaxed) >> (2 * FIELD)).wrapping_add(1) & ((1 << (64 - 2 * FIELD)) - 1);
    p.word.store(epoch << (2 * FIELD) | (n as u64) << FIELD, Release);
    work(p);
    let mut spins = 0u32;
    while p.done.load(Acquire) < n {
        std::hint::spin_loop();
        spins += 1;
        if spins % SPINS == 0 {
            thread::yield_now(); // a worker was descheduled mid-task: let it run
        }
    }
    if let Some(e) = lock(&p.panic).take() {
        resume_unwind(e);
    }
}

/// Claims and runs tasks of the published loop until none is left; true if it ran any.
fn work(p: &Pool) -> bool {
    let mut ran = false;
    loop {
        let w = p.word.load(Relaxed);
        let (n, next) = ((w >> FIELD) & MASK, w & MASK);
        if next >= n {
            return ran;
        }
        if p.word.compare_exchange_weak(w, w + 1, Acquire, Relaxed).is_err() {
            continue;
        }
        ran = true;
        // SAFETY: a claimed task keeps its loop (and `task`) alive until it is counted done.
        let task = unsafe { &**p.task.get() };
        IN_TASK.set(true);
        let r = catch_unwind(AssertUnwindSafe(|| task(next as usize)));
        IN_TASK.set(false);
        if let Err(e) = r {
            lock(&p.panic).get_or_insert(e);
        }
        p.done.fetch_add(1, Release);
    }
}

fn worker(p: &'static Pool) {
    loop {
        {
            let mut g = lock(&p.sleep);
            while !p.active.load(Acquire) {
                g = p.wake.wait(g).unwrap_or_else(|e| e.into_inner());
            }
        }
        // Spin while the session lasts and for GRACE after the last task this thread ran.
        let mut last = Instant::now();
        let mut spins = 0u32;
        loop {
            if work(p) {
                last = Instant::now();
                continue;
            }
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins % SPINS == 0 && !p.active.load(Relaxed) && last.elapsed() > GRACE {
                break;
            }
        }
    }
}

/// `f(c, chunk)` for every `size`-element chunk of `data` (the last may be shorter), as tasks.
pub fn for_chunks<T: Send>(data: &mut [T], size: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let (len, ptr) = (data.len(), Ptr(data.as_mut_ptr()));
    let size = size.max(1);
    for_each(len.div_ceil(size), |c| {
        let start = c * size;
        // SAFETY: chunks are disjoint and inside `data`, which is borrowed for the whole loop.
        let chunk = unsafe { std::slice::from_raw_parts_mut(ptr.at(start), size.min(len - start)) };
        f(c, chunk)
    });
}

struct Ptr<T>(*mut T);
// SAFETY: used only to hand disjoint chunks of one slice to tasks.
unsafe impl<T: Send> Sync for Ptr<T> {}
impl<T> Ptr<T> {
    fn at(&self, i: usize) -> *mut T {
        unsafe { self.0.add(i) }
    }
}
