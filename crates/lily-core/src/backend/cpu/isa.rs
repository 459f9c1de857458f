//! Which instruction set the CPU kernels run: an [`Isa`] is chosen once per process (the best
//! the CPU supports, or `LILY_CPU_ISA=portable|avx2|avx512` to force a lower one), and every
//! kernel takes it as an argument, so tests can run each path against the portable one.
//! One extension rides on AVX-512 without being an ISA of its own: avx512_bf16 (`vdpbf16ps`,
//! [`Isa::bf16_dot`]), which decode attention on a bf16 cache uses only when asked for
//! (`LILY_CPU_ISA=avx512bf16`: measured slower than the widening kernels so far); `avx512` and
//! the default run AVX-512 without it.
//! [`multiversion!`] compiles one `#[inline(always)]` body per vector width.

use std::sync::OnceLock;

/// Define `$name(isa, args..)` that runs the `#[inline(always)]` body `$body(isa, args..)`
/// compiled for the ISA's vector width, so plain lane loops in the body auto-vectorize to AVX2 /
/// AVX-512 (the crate itself is built for baseline x86_64).
macro_rules! multiversion {
    ($vis:vis fn $name:ident($($arg:ident : $ty:ty),*) = $body:ident;) => {
        $vis fn $name(isa: Isa, $($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
                unsafe fn v512(isa: Isa, $($arg: $ty),*) {
                    $body(isa, $($arg),*)
                }
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn v256(isa: Isa, $($arg: $ty),*) {
                    $body(isa, $($arg),*)
                }
                match isa {
                    // SAFETY: an Isa value other than Portable is only produced when available.
                    Isa::Avx512 => return unsafe { v512(isa, $($arg),*) },
                    Isa::Avx2 => return unsafe { v256(isa, $($arg),*) },
                    Isa::Portable => {}
                }
            }
            $body(isa, $($arg),*)
        }
    };
}

pub(crate) use multiversion;

/// Instruction sets with their own kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Plain Rust lane loops (auto-vectorized for the build's baseline target).
    Portable,
    /// x86_64 AVX2 + FMA + F16C (8 f32 lanes).
    Avx2,
    /// x86_64 AVX-512 F/BW/VL (16 f32 lanes).
    Avx512,
}

impl Isa {
    /// Whether this CPU can run the kernels of `self`.
    pub fn available(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Whether the CPU has avx512_bf16 on top of this ISA (AVX-512 only): `vdpbf16ps`, a bf16
    /// pair dot product with f32 accumulation.
    pub fn bf16_dot_available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        if self == Isa::Avx512 {
            return self.available() && is_x86_feature_detected!("avx512bf16");
        }
        false
    }

    /// Whether the production kernels of this ISA use avx512_bf16: available and asked for
    /// (`LILY_CPU_ISA=avx512bf16`). Off by default: measured quietly, the bf16 decode attention was
    /// slower than the widening kernels on both machines this project measures (2 threads, bf16 KV
    /// at 32K / 128K, `bench attention`: Sapphire Rapids 10.9 / 42.2 ms against 5.9 / 23.9, Zen 5
    /// 3.6-3.9 / 15.1-15.3 against 3.2 / 13.0; 2026-12-02). Decided once.
    pub fn bf16_dot(self) -> bool {
        static ASKED: OnceLock<bool> = OnceLock::new();
        self.bf16_dot_available() && *ASKED.get_or_init(|| std::env::var("LILY_CPU_ISA").as_deref() == Ok("avx512bf16"))
    }

    /// Every ISA this CPU can run, best last (the tests run each).
    pub fn all_available() -> Vec<Isa> {
        [Isa::Portable, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|i| i.available())
            .collect()
    }

    /// The ISA the production kernels use: the best available, capped by `LILY_CPU_ISA`.
    /// Decided once; an unknown or unavailable request falls back to the best available.
    pub fn get() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            let best = *Isa::all_available().last().unwrap_or(&Isa::Portable);
            let want = match std::env::var("LILY_CPU_ISA").as_deref() {
                Ok("portable") => Isa::Portable,
                Ok("avx2") => Isa::Avx2,
                Ok("avx512") | Ok("avx512bf16") => Isa::Avx512,
                _ => best,
            };
            if want.available() {
                want
            } else {
                best
            }
        })
    }
}
