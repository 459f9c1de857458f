//! Weight matrices as stored in a checkpoint: dense (f32 / f16 / bf16) or MLX affine-quantized
//! (packed u32 codes with a scale and bias per group of input columns), plus the plain
//! dequantization every kernel is checked against.
//!
//! MLX affine packing: codes of a row form a little-endian bit stream in u32 words; element j
//! of a b-bit row sits in word j*b/32 at bit (j*b) mod 32. The value is `scale * q + bias`,
//! with the scale and bias of group j / group_size of that row. Scales may be negative.

use crate::{
    error::{Error, Result},
    safetensors::{Bytes, DType},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    F32,
    F16,
    BF16,
    /// MLX affine quantization; `bits` in {2, 4, 8}, `group` in {32, 64, 128}.
    Affine {
        bits: u32,
        group: usize,
    },
}

/// Scales and biases of a quantized matrix, one per (row, group).
#[derive(Clone)]
pub struct Groups {
    pub dtype: DType, // F32, F16 or BF16
    pub scales: Bytes,
    pub biases: Bytes,
}

/// A linear weight `[experts?, rows, cols]` applied as `y = W x` (rows = outputs, cols = inputs).
///
/// It may be a *view* into a larger stored tensor: expert `e`, row `r` is stored row
/// `e * expert_stride + row_offset + r`. This lets the fused Hugging Face `gate_up_proj`
/// [E, 2I, D] serve as two [E, I, D] matrices without copying.
#[derive(Clone)]
pub struct Matrix {
    pub name: String,
    pub format: Format,
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
    pub expert_stride: usize,
    pub row_offset: usize,
    pub data: Bytes,
    pub groups: Option<Groups>,
}

#[inline]
pub fn bf16_to_f32(lo: u8, hi: u8) -> f32 {
    f32::from_bits(((hi as u32) << 24) | ((lo as u32) << 16))
}

#[inline]
pub fn read_scalar(dtype: DType, b: &[u8], i: usize) -> f32 {
    match dtype {
        DType::BF16 => bf16_to_f32(b[2 * i], b[2 * i + 1]),
        DType::F16 => half::f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32(),
        _ => f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]),
    }
}

impl Matrix {
    /// A whole stored tensor `[experts, rows, cols]`, not a view: expert e's rows follow expert
    /// e - 1's.
    pub fn whole(
        name: String,
        format: Format,
        [experts, rows, cols]: [usize; 3],
        data: Bytes,
        groups: Option<Groups>,
    ) -> Matrix {
        Matrix {
            name,
            format,
            experts,
            rows,
            cols,
            expert_stride: rows,
            row_offset: 0,
            data,
            groups,
        }
    }

    /// Bytes of packed data per stored row.
    pub fn row_bytes(&self) -> usize {
        match self.format {
            Format::F32 => 4 * self.cols,
            Format::F16 | Format::BF16 => 2 * self.cols,
            Format::Affine { bits, .. } => self.cols * bits as usize / 8,
        }
    }

    /// Groups per row (quantized only).
    pub fn groups_per_row(&self) -> usize {
        match self.format {
            Format::Affine { group, .. } => self.cols / group,
            _ => 0,
        }
    }

    /// Index of the stored row holding logical row `r` of expert `e`.
    #[inline]
    pub fn stored_row(&self, e: usize, r: usize) -> usize {
        e * self.expert_stride + self.row_offset + r
    }

    /// Bytes actually read to apply `rows` rows of this matrix once (for bandwidth figures).
    pub fn bytes_per_row(&self) -> usize {
        self.row_bytes()
            + self
                .groups
                .as_ref()
                .map_or(0, |g| 2 * self.groups_per_row() * g.dtype.size())
    }

    /// The packed bytes of stored rows `first..first + n`, and their scales / biases byte slices
    /// (rows are contiguous in each).
    #[inline]
    pub fn rows_parts(&self, first: usize, n: usize) -> (&[u8], &[u8], &[u8]) {
        let rb = self.row_bytes();
        let data = &self.data.as_slice()[first * rb..(first + n) * rb];
        match &self.groups {
            Some(g) => {
                let gb = self.groups_per_row() * g.dtype.size();
                (
                    data,
                    &g.scales.as_slice()[first * gb..(first + n) * gb],
                    &g.biases.as_slice()[first * gb..(first + n) * gb],
                )
            }
            None => (data, &[], &[]),
        }
    }

    /// The packed bytes of one stored row, and its scales / biases byte slices.
    #[inline]
    pub fn row_parts(&self, stored: usize) -> (&[u8], &[u8], &[u8]) {
        self.rows_parts(stored, 1)
    }

    /// The dtype of the affine scales and biases (BF16 where the matrix has none).
    #[inline]
    pub fn scale_dtype(&self) -> DType {
        self.groups.as_ref().map_or(DType::BF16, |g| g.dtype)
    }

    /// Reference dequantization of row `r` of expert `e` into `out[..cols]`, element by element.
    pub fn dequant_row(&self, e: usize, r: usize, out: &mut [f32]) {
        let (data, scales, biases) = self.row_parts(self.stored_row(e, r));
        match self.format {
            Format::F32 => (0..self.cols).for_each(|j| out[j] = read_scalar(DType::F32, data, j)),
            Format::F16 => (0..self.cols).for_each(|j| out[j] = read_scalar(DType::F16, data, j)),
            Format::BF16 => (0..self.cols).for_each(|j| out[j] = read_scalar(DType::BF16, data, j)),
            Format::Affine { bits, group } => {
                let sd = self.scale_dtype();
                let mask = (1u32 << bits) - 1;
                for j in 0..self.cols {
                    let bit = j * bits as usize;
                    let w = bit / 32;
                    let word = u32::from_le_bytes([data[4 * w], data[4 * w + 1], data[4 * w + 2], data[4 * w + 3]]);
                    let q = (word >> (bit % 32)) & mask;
                    let g = j / group;
                    out[j] = read_scalar(sd, scales, g) * q as f32 + read_scalar(sd, biases, g);
                }
            }
        }
    }
}

/// Check a dense or quantized matrix against its expected logical shape `[experts?, rows, cols]`.
pub(crate) fn shape_error(name: &str, expected: &[usize], found: &[usize]) -> Error {
    Error::weight(name, format!("expected shape {expected:?}, found {found:?}"))
}

pub(crate) fn float_format(name: &str, dtype: DType, dtype_name: &str) -> Result<Format> {
    match dtype {
        DType::F32 => Ok(Format::F32),
        DType::F16 => Ok(Format::F16),
        DType::BF16 => Ok(Format::BF16),
        _ => Err(Error::weight(
            name,
            format!("unsupported dtype {dtype_name} (expected BF16, F16, F32, or U32 with scales)"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_bits() {
        assert_eq!(bf16_to_f32(0x80, 0x3f), 1.0);
        assert_eq!(bf16_to_f32(0x00, 0xc0), -2.0);
    }
}
