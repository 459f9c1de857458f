//! The CPU thread pool: every task runs exactly once, loops nest, sessions from several threads
//! take turns, and a panicking task reaches the caller only after the others finished.

use std::{
    panic::{catch_unwind, AssertUnwindSafe},
    sync::atomic::{AtomicUsize, Ordering::SeqCst},
    thread,
};

use lily_core::backend::cpu::pool;

#[test]
fn every_task_runs_once_in_and_out_of_a_session() {
    for n in [0usize, 1, 2, 3, 17, 1000] {
        let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
        pool::for_each(n, |i| {
            hits[i].fetch_add(1, SeqCst);
        });
        pool::run(|| {
            for _ in 0..50 {
                pool::for_each(n, |i| {
                    hits[i].fetch_add(1, SeqCst);
                });
            }
        });
        assert!(hits.iter().all(|h| h.load(SeqCst) == 51), "n = {n}");
    }
}

#[test]
fn more_tasks_than_one_loop_counts() {
    // 2^20 + 3 tasks: the loop word counts 20 bits, so this runs as two loops.
    let n = (1 << 20) + 3;
    let hits: Vec<std::sync::atomic::AtomicU8> = (0..n).map(|_| Default::default()).collect();
    pool::for_each(n, |i| _ = hits[i].fetch_add(1, SeqCst));
    assert!(hits.iter().all(|h| h.load(SeqCst) == 1));
}

#[test]
fn chunks_cover_the_slice() {
    let mut v = vec![0usize; 1001];
    pool::for_chunks(&mut v, 64, |c, s| {
        for (i, x) in s.iter_mut().enumerate() {
            *x += c * 64 + i;
        }
    });
    assert!(v.iter().enumerate().all(|(i, &x)| x == i));
}

#[test]
fn a_loop_inside_a_task_runs_serially() {
    let total = AtomicUsize::new(0);
    pool::run(|| {
        pool::for_each(8, |_| {
            pool::for_each(8, |j| {
                total.fetch_add(j, SeqCst);
            })
        })
    });
    assert_eq!(total.load(SeqCst), 8 * 28);
}

#[test]
fn sessions_from_several_threads_take_turns() {
    let sums: Vec<usize> = thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|t| {
                s.spawn(move || {
                    let acc = AtomicUsize::new(0);
                    for _ in 0..200 {
                        pool::run(|| pool::for_each(16, |i| _ = acc.fetch_add(i + t, SeqCst)));
                    }
                    acc.load(SeqCst)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (t, s) in sums.into_iter().enumerate() {
        assert_eq!(s, 200 * (120 + 16 * t));
    }
}

#[test]
fn a_panicking_task_reaches_the_caller_after_the_rest() {
    let done = AtomicUsize::new(0);
    let r = catch_unwind(AssertUnwindSafe(|| {
        pool::for_each(64, |i| {
            if i == 5 {
                panic!("task 5");
            }
            thread::sleep(std::time::Duration::from_micros(50));
            done.fetch_add(1, SeqCst);
        })
    }));
    assert!(r.is_err());
    assert_eq!(done.load(SeqCst), 63);
    // The pool still works afterwards.
    let n = AtomicUsize::new(0);
    pool::for_each(10, |_| _ = n.fetch_add(1, SeqCst));
    assert_eq!(n.load(SeqCst), 10);
}
