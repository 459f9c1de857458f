//! `matmul`: out [T, N] = x[x_row0 + t, :K] W^T for t < T (`MatmulParams`), W [N, K] a weight
//! matrix in its checkpoint format (dense f32 / f16 / bf16 or MLX affine 2 / 4 / 8-bit, see
//! quant.rs), dequantized inside the kernel: x [*, K] f32, out [T, N] f32. `matmuls`: several
//! matrices reading the same x (a layer's input projections), which a backend may run as one
//! launch. Decode (T = 1) is a GEMV, bound by reading W; prefill a GEMM.

pub mod cpu;
pub mod cuda;
pub mod metal;
pub mod reference;
