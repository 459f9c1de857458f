//! Helpers shared by the kernel benchmarks: timing (median of runs), this machine's read and copy
//! bandwidth and f32 FMA peak (what a kernel's figure is a fraction of), random inputs.
#![allow(dead_code)] // each bench binary uses its own subset

use std::time::Instant;

use lily_core::backend::cpu::{isa::Isa, pool};

pub fn rand_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n.div_ceil(8))
        .flat_map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s.to_le_bytes()
        })
        .take(n)
        .collect()
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median seconds of `f` over `reps` runs after one warm-up. With `LILY_BENCH_CLOCK=cpu` the
/// process's CPU seconds instead of wall time: on a shared machine, with `LILY_THREADS=1`, that
/// is the kernel's own time, not its share of the cores (a development aid, not a quiet figure).
pub fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    let cpu = std::env::var("LILY_BENCH_CLOCK").is_ok_and(|c| c == "cpu");
    f();
    median(
        (0..reps)
            .map(|_| {
                let (t, c) = (Instant::now(), cpu_seconds());
                f();
                if cpu {
                    cpu_seconds() - c
                } else {
                    t.elapsed().as_secs_f64()
                }
            })
            .collect(),
    )
}

/// CPU seconds this process has used.
fn cpu_seconds() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid clock id and an out-pointer to a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Read bandwidth: every pool thread takes the max of its half of a 1 GiB byte buffer (a SIMD
/// reduction that does nothing but stream loads, AVX2 where there is one: SSE2 alone is
/// compute-bound on one core; GB/s, median).
pub fn read_bandwidth(reps: usize) -> f64 {
    let buf: Vec<u8> = (0..1usize << 30).map(|i| i as u8).collect();
    let threads = pool::threads();
    let chunk = buf.len().div_ceil(threads);
    let mut maxes = vec![0u8; threads];
    let s = time(reps, || {
        pool::for_chunks(&mut maxes, 1, |t, m| {
            m[0] = byte_max(&buf[t * chunk..((t + 1) * chunk).min(buf.len())])
        });
        std::hint::black_box(&maxes);
    });
    buf.len() as f64 / s / 1e9
}

/// The largest byte, 64 lanes at a time (independent lanes, so the loop is nothing but loads).
pub fn byte_max(c: &[u8]) -> u8 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        #[target_feature(enable = "avx2")]
        fn avx2(c: &[u8]) -> u8 {
            byte_max_body(c)
        }
        // SAFETY: AVX2 detected.
        return unsafe { avx2(c) };
    }
    byte_max_body(c)
}

#[inline(always)]
pub fn byte_max_body(c: &[u8]) -> u8 {
    let mut m = [0u8; 64];
    for v in c.chunks_exact(64) {
        for (a, &b) in m.iter_mut().zip(v) {
            *a = (*a).max(b);
        }
    }
    m.into_iter().max().unwrap_or(0)
}

/// Copy bandwidth as `lily bench` measures it: (read + write bytes) / time, 2 x 512 MiB.
pub fn copy_bandwidth(reps: usize) -> f64 {
    let src = vec![1f64; (1 << 29) / 8];
    let mut dst = vec![0f64; src.len()];
    let chunk = src.len().div_ceil(pool::threads());
    let s = time(reps, || {
        pool::for_chunks(&mut dst, chunk, |c, d| d.copy_from_slice(&src[c * chunk..][..d.len()]));
    });
    (2 * src.len() * 8) as f64 / s / 1e9
}

/// f32 FMA peak: independent register-resident FMA chains on every pool thread (GFLOP/s).
pub fn peak_gflops(isa: Isa, reps: usize) -> f64 {
    let threads = pool::threads();
    let iters = 2_000_000;
    let lanes = match isa {
        Isa::Avx512 => 16,
        Isa::Avx2 => 8,
        Isa::Portable => 4,
    };
    let chains = match isa {
        Isa::Avx2 => AVX2_CHAINS,
        _ => 16,
    };
    let s = time(reps, || {
        pool::for_each(threads, |_| {
            std::hint::black_box(fma_chains(isa, std::hint::black_box(iters)));
        })
    });
    (threads * iters * chains * lanes * 2) as f64 / s / 1e9
}

/// FMA chains of the AVX2 peak: 12 accumulators and the two constants fit AVX2's 16 ymm registers
/// (16 chains spilled two accumulators to the stack every round, and the store-to-load latency of
/// those chains read the peak at a third of what the GEMMs reach), and 12 still cover the FMA
/// latency x ports of the cores we run on (4 cycles x 2 ports on Zen 4 and Sapphire Rapids).
const AVX2_CHAINS: usize = 12;

/// Independent FMA chains (enough to cover latency x ports: 16 of 512 bits, [`AVX2_CHAINS`] of 256)
/// for `iters` rounds.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
pub fn fma_chains(isa: Isa, iters: usize) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn v512(iters: usize) -> f32 {
            let mut a = [_mm512_set1_ps(1.0); 16];
            let (m, c) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
            for _ in 0..iters {
                for v in a.iter_mut() {
                    *v = _mm512_fmadd_ps(*v, m, c);
                }
            }
            a.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn v256(iters: usize) -> f32 {
            let mut a = [_mm256_set1_ps(1.0); AVX2_CHAINS];
            let (m, c) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
            for _ in 0..iters {
                for v in a.iter_mut() {
                    *v = _mm256_fmadd_ps(*v, m, c);
                }
            }
            let mut o = [0f32; 8];
            let sum = a.iter().fold(_mm256_setzero_ps(), |s, v| _mm256_add_ps(s, *v));
            // SAFETY: o holds 8 floats.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), sum) };
            o.iter().sum()
        }
        match isa {
            // SAFETY: the ISA was checked available.
            Isa::Avx512 => return unsafe { v512(iters) },
            Isa::Avx2 => return unsafe { v256(iters) },
            Isa::Portable => {}
        }
    }
    let mut a = [[1f32; 4]; 16];
    for _ in 0..iters {
        for v in a.iter_mut() {
            for x in v.iter_mut() {
                *x = x.mul_add(0.999_999, 1e-7);
            }
        }
    }
    a.iter().flatten().sum()
}
