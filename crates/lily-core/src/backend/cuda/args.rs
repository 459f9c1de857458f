//! CUDA kernel arguments: the CUDA-only descriptors (`#[repr(C)]`, mirrored by
//! `shaders/cuda/common.cuh`, sizes asserted on both sides) and [`Args`], a launch's argument
//! values packed inline (no allocation) in parameter order, as `cuLaunchKernel` takes them.

use crate::backend::params::{
    AttentionParams, ConvParams, DeltaNetParams, KvStoreParams, MatmulParams, MoeParams, RmsNormParams, RopeParams,
    RouteParams, RowsParams,
};

/// A device address.
pub type DevPtr = u64;

/// A weight matrix `[experts?, rows, cols]` as the kernels see it (`CudaMatrix` in common.cuh):
/// logical row `r` of expert `e` is stored row `e * expert_stride + row_offset + r`; `group` the
/// quantization group (0: dense); `row_bytes` the bytes of a stored row; `vec` 1 when rows are
/// 16-byte aligned (the kernels then read 16-byte chunks).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaMatrix {
    pub rows: u32,
    pub cols: u32,
    pub expert_stride: u32,
    pub row_offset: u32,
    pub group: u32,
    pub row_bytes: u32,
    pub vec: u32,
    /// log2(group) for a power-of-two group, else 0 (the GEMV then divides).
    pub group_shift: u32,
}

/// Element type of a KV cache as the kernels read it (`KvDesc::dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvElem {
    F32 = 0,
    BF16 = 1,
    F16 = 2,
}

/// A KV cache as the attention kernels see it (`KvDesc` in common.cuh): `seg` is the device
/// address of an array of segment base addresses (u64 each); row `r` lives in segment
/// `r >> seg_shift` at row `r & ((1 << seg_shift) - 1)`, `width` elements of `dtype` a row.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvDesc {
    pub seg: DevPtr,
    pub width: u32,
    pub dtype: u32,
    pub seg_shift: u32,
    pub pad: u32,
}

/// Up to 4 matrices in one GEMV launch (`GemvMulti` in common.cuh): matrix `i` owns the blocks
/// `ends[i - 1] .. ends[i]` of the grid.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GemvMulti {
    pub count: u32,
    pub ends: [u32; 4],
    /// Warps per row group (`gemv_split`).
    pub ks: u32,
    pub pad: [u32; 2],
}

/// The expert-sorted prefill path of `moe_experts` (`MoeSortArgs` in common.cuh): E experts,
/// room for `max_tiles` tiles of 64 sorted rows.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeSortArgs {
    pub experts: u32,
    pub max_tiles: u32,
}

/// The MoE block's shared expert as each token's last (token, slot) pair of `moe_gate_up` /
/// `moe_down` (`MoeShared` in moe.cu): `shared` 1 runs it (pairs K + 1 a token), 0 not (the rest
/// unused); its gate, up and down descriptors, then each one's (weights, scales, biases).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MoeShared {
    pub gate: CudaMatrix,
    pub up: CudaMatrix,
    pub down: CudaMatrix,
    pub shared: u32,
    pub pad: u32,
    pub ptrs: [DevPtr; 9],
}

const _: () = assert!(size_of::<CudaMatrix>() == 32);
const _: () = assert!(size_of::<MoeShared>() == 176);
const _: () = assert!(size_of::<KvDesc>() == 24);
const _: () = assert!(size_of::<MoeSortArgs>() == 8);
const _: () = assert!(size_of::<GemvMulti>() == 32);

/// A value a kernel takes by value: `#[repr(C)]` of `u32` / `f32` / `u64` fields with no padding,
/// or a plain scalar.
///
/// # Safety
/// Implement only for such types: [`Args::push`] copies every byte of the value.
pub unsafe trait Param: Copy {}

macro_rules! params {
    ($($t:ty),* $(,)?) => {
        $(
            // SAFETY: repr(C) structs of 4- and 8-byte fields without padding, or scalars.
            unsafe impl Param for $t {}
        )*
    };
}

params!(
    RmsNormParams,
    MatmulParams,
    RopeParams,
    AttentionParams,
    KvStoreParams,
    ConvParams,
    DeltaNetParams,
    RouteParams,
    MoeParams,
    RowsParams,
    CudaMatrix,
    KvDesc,
    MoeSortArgs,
    MoeShared,
    GemvMulti,
    u32,
    u64,
);

/// The argument values of one launch, in parameter order, inline: each value starts 8-byte
/// aligned in `bytes`; `at[i]` is where value `i` starts. Comparing two `Args` compares the
/// launches' arguments exactly (the bytes past `len` are always zero).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Args {
    bytes: [u64; Args::WORDS],
    at: [u16; Args::MAX],
    n: u8,
    len: u16,
}

impl Args {
    /// The most arguments of one kernel (matmul_gemv_multi takes 23).
    pub const MAX: usize = 24;
    /// Bytes of argument values / 8 (the largest launch, moe_gate_up with its `MoeShared`, takes
    /// 328 bytes).
    pub const WORDS: usize = 41;

    pub fn new() -> Args {
        Args {
            bytes: [0; Args::WORDS],
            at: [0; Args::MAX],
            n: 0,
            len: 0,
        }
    }

    /// Append one argument value. Panics only on a kernel with more arguments or bytes than the
    /// limits above (a programming error, caught by the tests of every kernel).
    pub fn push<T: Param>(mut self, v: T) -> Args {
        let size = size_of::<T>();
        let at = (self.len as usize).next_multiple_of(8);
        assert!(
            (self.n as usize) < Args::MAX && at + size <= Args::WORDS * 8,
            "kernel arguments over the inline limit"
        );
        // SAFETY: `at + size` is inside `bytes` (checked above); T is a padding-free `Param`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                &v as *const T as *const u8,
                (self.bytes.as_mut_ptr() as *mut u8).add(at),
                size,
            );
        }
        self.at[self.n as usize] = at as u16;
        self.n += 1;
        self.len = (at + size) as u16;
        self
    }

    pub fn ptr(self, p: DevPtr) -> Args {
        self.push(p)
    }

    pub fn len(&self) -> usize {
        self.n as usize
    }
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The address of each argument value, for `cuLaunchKernel`'s `kernelParams` (valid while
    /// `self` is neither moved nor changed); a null pointer follows the last one.
    pub fn pointers(&mut self) -> [*mut std::ffi::c_void; Args::MAX + 1] {
        let mut p = [std::ptr::null_mut(); Args::MAX + 1];
        let base = self.bytes.as_mut_ptr() as *mut u8;
        for i in 0..self.n as usize {
            // SAFETY: every `at` lies inside `bytes`.
            p[i] = unsafe { base.add(self.at[i] as usize) } as *mut std::ffi::c_void;
        }
        p
    }
}

impl Default for Args {
    fn default() -> Self {
        Args::new()
    }
}

impl std::fmt::Debug for Args {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Args({} values, {} bytes)", self.n, self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_pack_in_order() {
        let m = CudaMatrix {
            rows: 1,
            cols: 2,
            ..Default::default()
        };
        let mut a = Args::new().push(7u32).push(m).ptr(0x1234_5678_9abc);
        assert_eq!(a.len(), 3);
        let p = a.pointers();
        // SAFETY: the pointers address the values pushed above, in `a`.
        unsafe {
            assert_eq!(*(p[0] as *const u32), 7);
            assert_eq!(*(p[1] as *const CudaMatrix), m);
            assert_eq!(*(p[2] as *const u64), 0x1234_5678_9abc);
        }
        assert!(p[3].is_null());
        assert_eq!(p[1] as usize % 8, 0);
        assert_eq!(Args::new().push(1u32), Args::new().push(1u32));
        assert_ne!(Args::new().push(1u32), Args::new().push(2u32));
    }
}
