//! Device-memory traffic of one simulated dispatch, observed by page protection (issue 12, item 9).
//!
//! The simulator's buffers are host memory: whole pages of their own, or whole pages of the mapped
//! checkpoint. Before a counted dispatch every page a binding (or a resident buffer) covers is made
//! `PROT_NONE`; a `SIGSEGV` handler records each page's first touch and opens it just as far as
//! the access needs (a read: `PROT_READ`; a write: read-write), so each page faults at most twice.
//! After the dispatch the pages get their protection back. A page counts the bytes of it that the
//! dispatch's bindings cover (not the whole page), so a small tensor counts its own size, and a
//! large one partly read counts whole pages: the granularity is 4 KiB inside a binding.
//!
//! Read or write: on x86-64 the fault's error code says which; elsewhere a first fault counts as
//! a read and the write faults again (a page only written then counts as read and written).
//! Only one counted dispatch runs at a time in a process ([`count`] holds a lock): the handler's
//! page table is process-wide. The dispatch itself may fault from several OS threads at once
//! (the simulator shares a dispatch's threadgroups out over them): the handler only or-s flags
//! into the page table and widens a page's protection.

use std::{
    cell::UnsafeCell,
    ffi::c_void,
    sync::{
        atomic::{AtomicPtr, AtomicU8, Ordering},
        Mutex,
    },
};

use crate::error::{Error, Result};

const PAGE: usize = 4096;
const READ: u8 = 1;
const WRITTEN: u8 = 2;

/// One byte range a dispatch may touch, and whether the kernel may write it (a mapped
/// checkpoint's pages are read-only).
#[derive(Clone, Copy, Debug)]
pub struct Range {
    pub start: usize,
    pub len: usize,
    pub writable: bool,
}

/// Bytes a dispatch read and wrote (pages touched x the bytes of them its bindings cover).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bytes {
    pub read: u64,
    pub written: u64,
}

struct Page {
    addr: usize,
    /// Bytes of the page inside some binding.
    covered: u32,
    writable: bool,
    seen: AtomicU8,
}

/// The pages of the running counted dispatch, sorted by address (null between dispatches).
static PAGES: AtomicPtr<Vec<Page>> = AtomicPtr::new(std::ptr::null_mut());

/// The `SIGSEGV` action in place before ours: a fault outside [`PAGES`] goes back to it.
struct Previous(UnsafeCell<libc::sigaction>);
// SAFETY: written only under COUNTING, before the handler is installed; read by the handler.
unsafe impl Sync for Previous {}
static PREVIOUS: Previous = Previous(UnsafeCell::new(unsafe { std::mem::zeroed() }));
static COUNTING: Mutex<()> = Mutex::new(());

/// Whether the faulting access was a write, where the platform says (x86-64: bit 1 of the page
/// fault's error code); `None` elsewhere.
fn fault_is_write(ctx: *mut c_void) -> Option<bool> {
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    {
        // SAFETY: the kernel passes a ucontext_t to an SA_SIGINFO handler.
        let uc = unsafe { &*(ctx as *const libc::ucontext_t) };
        Some(uc.uc_mcontext.gregs[libc::REG_ERR as usize] & 2 != 0)
    }
    #[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
    {
        let _ = ctx;
        None
    }
}

extern "C" fn on_fault(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
    // SAFETY: only async-signal-safe work: atomics, a binary search over a table that stays
    // alive while PAGES points at it, mprotect and sigaction.
    unsafe {
        let addr = (*info).si_addr() as usize & !(PAGE - 1);
        let pages = PAGES.load(Ordering::Acquire);
        if !pages.is_null() {
            let pages = &*pages;
            if let Ok(i) = pages.binary_search_by_key(&addr, |p| p.addr) {
                let p = &pages[i];
                let write = match fault_is_write(ctx) {
                    Some(w) => w,
                    // the second fault of a page can only be a write
                    None => p.seen.load(Ordering::Relaxed) & READ != 0,
                };
                if !write || p.writable {
                    let flag = if write { WRITTEN } else { READ };
                    // The simulator's OS threads fault at once (the threadgroups of a dispatch
                    // run in parallel): the flags are or-ed in, and the page opened as far as
                    // every access so far needs (a late read never closes it to writes; a write
                    // that still faults after a racing read lands here again).
                    let seen = p.seen.fetch_or(flag, Ordering::Relaxed) | flag;
                    let prot = if seen & WRITTEN != 0 {
                        libc::PROT_READ | libc::PROT_WRITE
                    } else {
                        libc::PROT_READ
                    };
                    if libc::mprotect(addr as *mut c_void, PAGE, prot) == 0 {
                        return;
                    }
                }
            }
        }
        // Not ours (or a write to a read-only weight): the access faults again into the action
        // that was there before.
        libc::sigaction(sig, PREVIOUS.0.get(), std::ptr::null_mut());
    }
}

/// Set the protection of every page in `pages` (consecutive pages in one call).
fn protect(pages: &[Page], prot: impl Fn(&Page) -> libc::c_int) -> Result<()> {
    let mut i = 0;
    while i < pages.len() {
        let p = prot(&pages[i]);
        let mut j = i + 1;
        while j < pages.len() && pages[j].addr == pages[j - 1].addr + PAGE && prot(&pages[j]) == p {
            j += 1;
        }
        // SAFETY: whole pages of live simulator buffers (their own allocation or the mapping).
        if unsafe { libc::mprotect(pages[i].addr as *mut c_void, (j - i) * PAGE, p) } != 0 {
            return Err(Error::Device(format!(
                "metal-sim: cannot protect buffer pages for traffic counting: {}",
                std::io::Error::last_os_error()
            )));
        }
        i = j;
    }
    Ok(())
}

/// The pages `ranges` cover, each with the bytes of it inside some range, sorted.
fn pages_of(ranges: &[Range]) -> Vec<Page> {
    let mut rs: Vec<Range> = ranges.iter().copied().filter(|r| r.len > 0).collect();
    rs.sort_by_key(|r| r.start);
    // Merge overlapping ranges (a buffer bound twice, a resident buffer that is also bound).
    let mut merged: Vec<Range> = Vec::with_capacity(rs.len());
    for r in rs {
        match merged.last_mut() {
            Some(m) if r.start <= m.start + m.len => {
                m.len = m.len.max(r.start + r.len - m.start);
                m.writable |= r.writable;
            }
            _ => merged.push(r),
        }
    }
    let mut pages: Vec<Page> = Vec::new();
    for r in merged {
        let end = r.start + r.len;
        let mut a = r.start & !(PAGE - 1);
        while a < end {
            let covered = (end.min(a + PAGE) - r.start.max(a)) as u32;
            match pages.last_mut() {
                Some(p) if p.addr == a => {
                    p.covered += covered;
                    p.writable |= r.writable;
                }
                _ => pages.push(Page {
                    addr: a,
                    covered,
                    writable: r.writable,
                    seen: AtomicU8::new(0),
                }),
            }
            a += PAGE;
        }
    }
    pages
}

/// Run `dispatch` with the pages of `ranges` protected, and count what it touched.
pub fn count<T>(ranges: &[Range], dispatch: impl FnOnce() -> T) -> Result<(T, Bytes)> {
    let _one = COUNTING.lock().unwrap_or_else(|e| e.into_inner());
    let pages = Box::new(pages_of(ranges));
    // SAFETY: a zeroed sigaction is a valid "no flags" action; the handler is SA_SIGINFO.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_fault as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_NODEFER;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(libc::SIGSEGV, &sa, PREVIOUS.0.get()) != 0 {
            return Err(Error::Device(
                "metal-sim: cannot install the traffic fault handler".into(),
            ));
        }
    }
    let raw = Box::into_raw(pages);
    PAGES.store(raw, Ordering::Release);
    // SAFETY: `raw` stays alive until it is taken back below.
    let pages = unsafe { &*raw };
    let result = protect(pages, |_| libc::PROT_NONE).map(|()| dispatch());
    let restored = protect(pages, |p| {
        if p.writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        }
    });
    PAGES.store(std::ptr::null_mut(), Ordering::Release);
    // SAFETY: the previous action, saved above.
    unsafe { libc::sigaction(libc::SIGSEGV, PREVIOUS.0.get(), std::ptr::null_mut()) };
    // SAFETY: from Box::into_raw above; no handler can see it any more.
    let pages = unsafe { Box::from_raw(raw) };
    let out = result?;
    restored?;
    let mut bytes = Bytes::default();
    for p in pages.iter() {
        let seen = p.seen.load(Ordering::Relaxed);
        if seen & READ != 0 {
            bytes.read += p.covered as u64;
        }
        if seen & WRITTEN != 0 {
            bytes.written += p.covered as u64;
        }
    }
    Ok((out, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_pages_touched_by_their_covered_bytes() {
        let layout = std::alloc::Layout::from_size_align(8 * PAGE, PAGE).unwrap();
        // SAFETY: a fresh page-aligned allocation of 8 pages, freed below.
        let base = unsafe { std::alloc::alloc_zeroed(layout) } as usize;
        let ranges = [
            Range {
                start: base,
                len: 4 * PAGE,
                writable: true,
            },
            // 100 bytes of page 6: counted as 100 bytes.
            Range {
                start: base + 6 * PAGE + 8,
                len: 100,
                writable: true,
            },
        ];
        let ((), b) = count(&ranges, || unsafe {
            let p = base as *mut u8;
            let _ = std::ptr::read_volatile(p.add(10)); // page 0 read
            let _ = std::ptr::read_volatile(p.add(PAGE + 5)); // page 1 read, then written
            std::ptr::write_volatile(p.add(PAGE + 6), 1);
            std::ptr::write_volatile(p.add(3 * PAGE), 2); // page 3 written
            let _ = std::ptr::read_volatile(p.add(6 * PAGE + 20)); // the 100-byte range
        })
        .unwrap();
        let write_only_reads = if cfg!(all(target_os = "linux", target_arch = "x86_64")) {
            0
        } else {
            PAGE
        };
        assert_eq!(b.read as usize, 2 * PAGE + 100 + write_only_reads);
        assert_eq!(b.written as usize, 2 * PAGE);
        // Protection is back: the buffer reads and writes freely.
        unsafe {
            let p = base as *mut u8;
            std::ptr::write_volatile(p.add(2 * PAGE), 3);
            assert_eq!(std::ptr::read_volatile(p.add(PAGE + 6)), 1);
            std::alloc::dealloc(p, layout);
        }
    }
}
