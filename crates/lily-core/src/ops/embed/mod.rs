//! `embed`: out[t, :] = dequant(table row ids[t]); table [V, D] in its checkpoint format
//! (dense or MLX affine, dequantized as it is read), ids [T] u32, out [T, D] f32.

pub mod cpu;
pub mod cuda;
pub mod metal;
pub mod reference;
