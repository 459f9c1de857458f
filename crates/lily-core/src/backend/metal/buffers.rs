//! Metal buffers as the op encoders bind them: f32 / u32 buffers ([`MetalBuf`]) and weight
//! matrices in their checkpoint format ([`MetalMatrix`]: packed data, scales and biases, and the
//! [`MatrixDesc`] the kernels read them through).

use std::sync::Arc;

use super::{Arg, Executor, Metal, Weight};
use crate::{
    backend::{
        cpu::kv::{check_copy, check_read, check_share, segment_list, segment_rows, touched, widen},
        params::{KvLayout, MatrixDesc},
        KvDtype, KvSegment,
    },
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
        // Each tensor wrapped in place where the device can, else copied (and counted).
        let place = |bytes: &crate::safetensors::Bytes| -> Result<(X::Buffer, usize, usize)> {
            let p = self.x.weight_buffer(bytes)?;
            if p.copied {
                self.count_copy(bytes.len());
            }
            Ok((p.buf, p.offset, bytes.len()))
        };
        let data = place(&m.data)?;
        let groups = match &m.groups {
            Some(g) => Some([place(&g.scales)?, place(&g.biases)?]),
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
            data,
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

/// One attention layer's K (or V) cache on the device: segments of `1 << shift` rows of `width`
/// values of the cache dtype, each its own buffer, allocated as the sequence grows, and `table`,
/// the GPU addresses of the segments in order (a kernel finds row r in segment r >> shift).
/// The table is sized for `max_rows` once, so it never moves. A fork's table points at its
/// source's whole segments (the same buffers, [`Metal::kv_share`]) until a write needs a private
/// copy ([`Metal::kv_unshare`]); `holders[i]` counts the caches holding segment i.
pub struct MetalKv<X: Executor> {
    pub(crate) width: usize,
    pub(crate) dtype: KvDtype,
    pub(crate) shift: u32,
    pub(crate) max_rows: usize,
    /// Kept apart from `holders` so a kernel's residency list is this slice as it is.
    pub(crate) segs: Vec<X::Buffer>,
    holders: Vec<Arc<()>>,
    pub(crate) table: X::Buffer,
}

impl<X: Executor> MetalKv<X> {
    pub fn rows(&self) -> usize {
        self.segs.len() << self.shift
    }
    pub fn bytes(&self) -> usize {
        self.rows() * self.width * self.dtype.size()
    }
    fn seg_bytes(&self) -> usize {
        (self.width * self.dtype.size()) << self.shift
    }
    /// What the kernels are told of the layout.
    pub(crate) fn layout(&self) -> KvLayout {
        KvLayout {
            seg_shift: self.shift,
            segments: self.segs.len() as u32,
        }
    }
    /// The segment table as a binding.
    pub(crate) fn arg(&self) -> Arg<'_, X::Buffer> {
        Arg::Buf(&self.table, 0, 8 * self.max_rows.div_ceil(1 << self.shift).max(1))
    }
}

impl<X: Executor> Metal<X> {
    pub(super) fn kv_new(&self, width: usize, dtype: KvDtype, max_rows: usize, rows: usize) -> Result<MetalKv<X>> {
        if !rows.is_power_of_two() {
            return Err(Error::InvalidArgument(format!(
                "KV segment rows {rows}: not a power of two"
            )));
        }
        // A segment's element offsets must fit the kernels' 32-bit row arithmetic.
        rows.checked_mul(width)
            .and_then(|n| n.checked_mul(dtype.size()))
            .filter(|&n| width > 0 && u32::try_from(n).is_ok())
            .ok_or_else(|| Error::InvalidArgument(format!("KV row width {width} is not usable")))?;
        let entries = max_rows.div_ceil(rows).max(1);
        Ok(MetalKv {
            width,
            dtype,
            shift: rows.trailing_zeros(),
            max_rows,
            segs: Vec::new(),
            holders: Vec::new(),
            table: self.x.new_buffer(8 * entries)?,
        })
    }

    pub(super) fn kv_reserve(&self, kv: &mut MetalKv<X>, rows: usize) -> Result<()> {
        if rows > kv.max_rows {
            return Err(Error::InvalidArgument(format!(
                "KV cache asked for {rows} rows, more than its max_seq {}",
                kv.max_rows
            )));
        }
        while kv.rows() < rows {
            let seg = self.x.new_buffer(kv.seg_bytes())?;
            self.kv_point(kv, kv.segs.len(), &seg);
            kv.segs.push(seg);
            kv.holders.push(Arc::new(()));
        }
        Ok(())
    }

    /// Table entry `s` of `kv` = the address of `seg`.
    fn kv_point(&self, kv: &MetalKv<X>, s: usize, seg: &X::Buffer) {
        let addr = self.x.gpu_address(seg);
        debug_assert!(
            s < kv.max_rows.div_ceil(1 << kv.shift).max(1),
            "segment {s} past the table"
        );
        // SAFETY: the table holds one u64 per segment up to max_rows (sized in kv_new; checked
        // above), is CPU-visible, and no command stream is in flight between forward calls.
        unsafe {
            let slot = self.x.contents(&kv.table).cast::<u64>().add(s);
            slot.write_unaligned(addr);
        }
    }

    /// A new cache of rows 0..rows of `src`: its table points at the whole segments of `src`,
    /// the partial last one is copied on the host (shared memory; pending work first).
    pub(super) fn kv_share(&self, src: &MetalKv<X>, rows: usize) -> Result<MetalKv<X>> {
        check_share(src.rows(), rows)?;
        self.flush()?;
        let mut dst = self.kv_new(src.width, src.dtype, src.max_rows, 1 << src.shift)?;
        let whole = rows >> src.shift;
        for s in 0..whole {
            self.kv_point(&dst, s, &src.segs[s]);
            dst.segs.push(src.segs[s].clone());
            dst.holders.push(src.holders[s].clone());
        }
        let part = rows & ((1 << src.shift) - 1);
        if part > 0 {
            let seg = self.x.new_buffer(src.seg_bytes())?;
            // SAFETY: both buffers hold a whole segment of this layout; `part` rows are inside;
            // distinct buffers; no command stream in flight (flushed above).
            unsafe {
                let n = part * src.width * src.dtype.size();
                std::ptr::copy_nonoverlapping(self.x.contents(&src.segs[whole]), self.x.contents(&seg), n)
            };
            self.kv_point(&dst, whole, &seg);
            dst.segs.push(seg);
            dst.holders.push(Arc::new(()));
        }
        Ok(dst)
    }

    /// Private copies of the shared segments rows row0..row0 + rows touch.
    pub(super) fn kv_unshare(&self, kv: &mut MetalKv<X>, row0: usize, rows: usize) -> Result<()> {
        for s in touched(row0, rows, kv.shift, kv.segs.len()) {
            if Arc::get_mut(&mut kv.holders[s]).is_none() {
                self.flush()?;
                let seg = self.x.new_buffer(kv.seg_bytes())?;
                // SAFETY: two whole segments of this layout, distinct; nothing in flight.
                unsafe {
                    std::ptr::copy_nonoverlapping(self.x.contents(&kv.segs[s]), self.x.contents(&seg), kv.seg_bytes())
                };
                self.kv_point(kv, s, &seg);
                kv.segs[s] = seg;
                kv.holders[s] = Arc::new(());
            }
        }
        Ok(())
    }

    pub(super) fn kv_segments(&self, kv: &MetalKv<X>) -> Vec<KvSegment> {
        segment_list(&kv.holders, kv.seg_bytes())
    }

    pub(super) fn kv_trim(&self, kv: &mut MetalKv<X>, rows: usize) {
        let keep = rows.div_ceil(1 << kv.shift);
        while kv.segs.len() > keep {
            kv.segs.pop();
            kv.holders.pop();
            // SAFETY: as in kv_reserve; the dropped segment's entry is cleared.
            unsafe {
                let slot = self.x.contents(&kv.table).cast::<u64>().add(kv.segs.len());
                slot.write_unaligned(0);
            }
        }
    }
}

impl<X: Executor> Metal<X> {
    /// Rows 0..rows of `src` into `dst`, segment by segment on the host (shared memory), after
    /// the pending work that may write them.
    pub(super) fn kv_copy(&self, src: &MetalKv<X>, dst: &mut MetalKv<X>, rows: usize) -> Result<()> {
        check_copy(
            (dst.width, dst.dtype, dst.shift, dst.rows()),
            (src.width, src.dtype, src.shift, src.rows()),
            rows,
        )?;
        self.flush()?;
        // Rows another cache shares are copied first, not overwritten under it.
        self.kv_unshare(dst, 0, rows)?;
        for ((from, to), n) in src.segs.iter().zip(&dst.segs).zip(segment_rows(rows, src.shift)) {
            let bytes = n * src.width * src.dtype.size();
            // SAFETY: both segments hold 2^shift rows of the same width and dtype (checked), so
            // `bytes` is inside each; distinct caches (&/&mut); no command stream in flight.
            unsafe { std::ptr::copy_nonoverlapping(self.x.contents(from), self.x.contents(to), bytes) };
        }
        Ok(())
    }

    /// Rows row0.. of `kv` widened to f32 (pending work first: the rows may be written by it).
    pub(super) fn kv_read(&self, kv: &MetalKv<X>, row0: usize, out: &mut [f32]) -> Result<()> {
        self.flush()?;
        let w = kv.width;
        check_read(w, kv.rows(), row0, out.len())?;
        let mask = (1usize << kv.shift) - 1;
        for (i, o) in out.chunks_exact_mut(w).enumerate() {
            let r = row0 + i;
            let base = self.x.contents(&kv.segs[r >> kv.shift]);
            let off = (r & mask) * w;
            // SAFETY: the segment holds 1 << shift rows of w elements of the dtype; row r & mask
            // is inside it; no command stream is in flight (flushed above).
            unsafe {
                match kv.dtype {
                    KvDtype::F32 => o.copy_from_slice(std::slice::from_raw_parts(base.cast::<f32>().add(off), w)),
                    d => widen(d, std::slice::from_raw_parts(base.cast::<u16>().add(off), w), o),
                }
            }
        }
        Ok(())
    }
}
