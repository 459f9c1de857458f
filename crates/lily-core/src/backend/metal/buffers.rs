//! Metal buffers as the op encoders bind them: f32 / u32 buffers ([`MetalBuf`]) and weight
//! matrices in their checkpoint format ([`MetalMatrix`]: packed data, scales and biases, and the
//! [`MatrixDesc`] the kernels read them through).

use super::{Arg, Executor, Metal, Weight};
use crate::{
    backend::params::MatrixDesc,
    error::{Error, Result},
    quant::{Format, Matrix},
    safetensors::DType,
};

/// A device buffer of `len` 4-byte elements (f32 values or u32 ids).
pub struct MetalBuf<X: Executor> {
    pub(super) buf: X::Buffer,
    len: usize,
}

impl<X: Executor> MetalBuf<X> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The whole buffer as a binding.
    pub(crate) fn arg(&self) -> Arg<'_, X::Buffer> {
        Arg::Buf(&self.buf, 0, self.len * 4)
    }
    /// Elements `first .. first + len` as a binding (disjoint regions of one scratch buffer).
    pub(crate) fn part(&self, first: usize, len: usize) -> Arg<'_, X::Buffer> {
        Arg::Buf(&self.buf, first * 4, len * 4)
    }
    /// Another handle to the same device memory.
    pub(super) fn handle(&self) -> Self {
        MetalBuf {
            buf: self.buf.clone(),
            len: self.len,
        }
    }
}

/// A weight matrix on the device: packed data, scales and biases as (buffer, offset, bytes).
pub struct MetalMatrix<X: Executor> {
    data: (X::Buffer, usize, usize),
    groups: Option<[(X::Buffer, usize, usize); 2]>,
    pub(crate) desc: MatrixDesc,
    /// Experts stacked in the matrix (1 for a plain matrix).
    pub(crate) experts: u32,
    /// The weight format (its host-name suffix: `q4_bf16`, `bf16`, ...).
    pub(crate) weight: Weight,
}

fn weight_format(m: &Matrix) -> Result<Weight> {
    let scale = |d: DType| match d {
        DType::BF16 => Ok("bf16"),
        DType::F16 => Ok("f16"),
        DType::F32 => Ok("f32"),
        _ => Err(Error::weight(&m.name, "scales must be BF16, F16 or F32")),
    };
    let dense = |s: &str| Weight::from_suffix(s).ok_or_else(|| Error::weight(&m.name, "no Metal kernel"));
    Ok(match m.format {
        Format::F32 => dense("f32")?,
        Format::F16 => dense("f16")?,
        Format::BF16 => dense("bf16")?,
        Format::Affine { bits, group } => {
            let sd = scale(m.scale_dtype())?;
            if group % 8 != 0 || m.cols % group != 0 || (m.cols * bits as usize) % 32 != 0 {
                return Err(Error::weight(
                    &m.name,
                    format!(
                        "the Metal kernels need cols ({}) a multiple of the group ({group}), itself a multiple of 8",
                        m.cols
                    ),
                ));
            }
            match Weight::from_suffix(&format!("q{bits}_{sd}")) {
                Some(w) => w,
                None => {
                    return Err(Error::weight(
                        &m.name,
                        format!("{bits}-bit weights have no Metal kernel (2, 4 and 8 do)"),
                    ))
                }
            }
        }
    })
}

impl<X: Executor> Metal<X> {
    pub(super) fn new_buf(&self, len: usize) -> Result<MetalBuf<X>> {
        Ok(MetalBuf {
            buf: self.x.new_buffer(len * 4)?,
            len,
        })
    }

    pub(super) fn upload_f32(&self, data: &[f32]) -> Result<MetalBuf<X>> {
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        Ok(MetalBuf {
            buf: self.x.new_buffer_with(&bytes)?,
            len: data.len(),
        })
    }

    /// `m` on the device: its bytes wrapped (or copied once) and its descriptor.
    pub(super) fn matrix(&self, m: &Matrix) -> Result<MetalMatrix<X>> {
        let weight = weight_format(m)?;
        let too_big =
            |v: usize| u32::try_from(v).map_err(|_| Error::weight(&m.name, "too large for 32-bit kernel indices"));
        let stored_rows = m.data.len() / m.row_bytes().max(1);
        too_big(stored_rows.saturating_mul(m.cols))?;
        let (b, off) = self.x.weight_buffer(&m.data)?;
        let groups = match &m.groups {
            Some(g) => {
                let (s, so) = self.x.weight_buffer(&g.scales)?;
                let (bi, bo) = self.x.weight_buffer(&g.biases)?;
                Some([(s, so, g.scales.len()), (bi, bo, g.biases.len())])
            }
            None => None,
        };
        let group = match m.format {
            Format::Affine { group, .. } => group,
            _ => 0,
        };
        let desc = MatrixDesc {
            rows: too_big(m.rows)?,
            cols: too_big(m.cols)?,
            expert_stride: too_big(m.expert_stride)?,
            row_offset: too_big(m.row_offset)?,
            group: group as u32,
            ..Default::default()
        };
        Ok(MetalMatrix {
            data: (b, off, m.data.len()),
            groups,
            desc,
            experts: too_big(m.experts.max(1))?,
            weight,
        })
    }

    /// The bindings of a matrix's data, scales and biases (a dummy buffer for dense weights).
    pub(crate) fn weights<'a>(&'a self, m: &'a MetalMatrix<X>) -> [Arg<'a, X::Buffer>; 3] {
        let (b, o, l) = &m.data;
        match &m.groups {
            Some([s, bi]) => [
                Arg::Buf(b, *o, *l),
                Arg::Buf(&s.0, s.1, s.2),
                Arg::Buf(&bi.0, bi.1, bi.2),
            ],
            None => [
                Arg::Buf(b, *o, *l),
                Arg::Buf(&self.dummy, 0, 16),
                Arg::Buf(&self.dummy, 0, 16),
            ],
        }
    }
}
