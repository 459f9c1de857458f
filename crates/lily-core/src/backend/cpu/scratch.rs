//! Per-thread scratch for the CPU kernels: [`with_task`] lends a task's thread a reusable buffer;
//! [`with_caller`] lends the calling thread one for data shared by every task of a call
//! (prepared x). Both grow once and are then reused, so a decode step allocates nothing. [`Out`]
//! is the output pointer tasks share when each writes its own elements.

use std::cell::RefCell;

thread_local! {
    static TASK: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static CALLER: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static CALLER_IDS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    static CALLER_OUTS: RefCell<Vec<Out>> = const { RefCell::new(Vec::new()) };
}

fn lend<T: Copy + Default, R>(
    key: &'static std::thread::LocalKey<RefCell<Vec<T>>>,
    len: usize,
    f: impl FnOnce(&mut [T]) -> R,
) -> R {
    key.with(|r| {
        // A nested borrow (a kernel called from inside a task of another) gets a fresh buffer
        // instead of a panic; no kernel does that today.
        match r.try_borrow_mut() {
            Ok(mut v) => {
                if v.len() < len {
                    v.resize(len, T::default());
                }
                f(&mut v[..len])
            }
            Err(_) => f(&mut vec![T::default(); len]),
        }
    })
}

/// Per-task scratch of `len` floats (contents unspecified).
pub fn with_task<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    lend(&TASK, len, f)
}

/// Calling-thread scratch of `len` floats for data the tasks of one call share.
pub fn with_caller<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    lend(&CALLER, len, f)
}

/// Calling-thread scratch of `len` u32 (expert grouping).
pub fn with_caller_ids<R>(len: usize, f: impl FnOnce(&mut [u32]) -> R) -> R {
    lend(&CALLER_IDS, len, f)
}

/// Calling-thread scratch of `len` output pointers (contents unspecified): one state per sequence
/// for the tasks of a batched op.
pub fn with_caller_outs<R>(len: usize, f: impl FnOnce(&mut [Out]) -> R) -> R {
    lend(&CALLER_OUTS, len, f)
}

/// A raw output pointer shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
pub struct Out(pub *mut f32);
impl Default for Out {
    fn default() -> Self {
        Out(std::ptr::null_mut())
    }
}
// SAFETY: every use writes a set of indices no other task touches, inside one parallel call.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}
impl Out {
    /// The pointer `i` elements on (a row of a batch's output).
    #[inline]
    pub fn at(self, i: usize) -> Out {
        Out(self.0.wrapping_add(i))
    }
    /// # Safety
    /// `i` is in bounds of the buffer and written by this task alone.
    #[inline]
    pub unsafe fn set(self, i: usize, v: f32) {
        unsafe { *self.0.add(i) = v }
    }
    /// # Safety
    /// `start..start + len` is in bounds of the buffer, and no other live reference overlaps it.
    #[inline]
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice<'a>(self, start: usize, len: usize) -> &'a mut [f32] {
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}
