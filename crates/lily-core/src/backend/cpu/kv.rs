//! The CPU's KV-cache memory: rows of `width` values in segments of `kv_segment_rows()` rows,
//! allocated as the sequence grows and freed on trim. f32 caches hold f32; 16-bit caches hold the
//! bit patterns (bf16 or IEEE half), widened by the kernels ([`CpuKv::rows_f32`]). Segments are
//! reference-counted: a fork shares its source's whole segments ([`CpuKv::share`]) and copies one
//! before writing into it ([`CpuKv::unshare`]).

use std::sync::Arc;

use half::{bf16, f16, slice::HalfFloatSliceExt};

use super::zeroed;
use crate::{
    backend::{KvDtype, KvSegment},
    error::{Error, Result},
};

/// A segment's storage: f32 values or 16-bit patterns.
#[derive(Clone)]
pub enum Segment {
    F32(Vec<f32>),
    Half(Vec<u16>),
}

/// Stored KV rows as a kernel reads them: f32 values, or the 16-bit patterns of a dtype (bf16,
/// f16) widened in registers.
#[derive(Clone, Copy)]
pub enum KvRows<'a> {
    F32(&'a [f32]),
    Half(KvDtype, &'a [u16]),
}

impl<'a> KvRows<'a> {
    /// Values held.
    #[inline(always)]
    pub fn values(self) -> usize {
        match self {
            KvRows::F32(v) => v.len(),
            KvRows::Half(_, v) => v.len(),
        }
    }

    /// The same rows from `n` values further on.
    #[inline(always)]
    pub fn skip(self, n: usize) -> KvRows<'a> {
        match self {
            KvRows::F32(v) => KvRows::F32(&v[n..]),
            KvRows::Half(d, v) => KvRows::Half(d, &v[n..]),
        }
    }
}

pub struct CpuKv {
    pub width: usize,
    pub dtype: KvDtype,
    /// log2 of the rows per segment.
    pub shift: u32,
    pub max_rows: usize,
    /// Shared with the caches of forks while no one writes them.
    pub segs: Vec<Arc<Segment>>,
}

impl CpuKv {
    pub fn new(width: usize, dtype: KvDtype, max_rows: usize, rows: usize) -> Result<CpuKv> {
        if !rows.is_power_of_two() {
            return Err(Error::InvalidArgument(format!(
                "KV segment rows {rows}: not a power of two"
            )));
        }
        if width == 0 || rows.checked_mul(width).and_then(|n| n.checked_mul(4)).is_none() {
            return Err(Error::InvalidArgument(format!("KV row width {width} is not usable")));
        }
        Ok(CpuKv {
            width,
            dtype,
            shift: rows.trailing_zeros(),
            max_rows,
            segs: Vec::new(),
        })
    }

    pub fn seg_rows(&self) -> usize {
        1 << self.shift
    }

    pub fn rows(&self) -> usize {
        self.segs.len() << self.shift
    }

    pub fn reserve(&mut self, rows: usize) -> Result<()> {
        if rows > self.max_rows {
            return Err(Error::InvalidArgument(format!(
                "KV cache asked for {rows} rows, more than its max_seq {}",
                self.max_rows
            )));
        }
        while self.rows() < rows {
            let seg = self.new_segment()?;
            self.segs.push(Arc::new(seg));
        }
        Ok(())
    }

    fn new_segment(&self) -> Result<Segment> {
        let n = self.seg_rows() * self.width;
        Ok(match self.dtype {
            KvDtype::F32 => Segment::F32(zeroed(n)?),
            KvDtype::BF16 | KvDtype::F16 => Segment::Half(zeroed(n)?),
        })
    }

    /// A private copy of the first `rows` rows of segment `s` (a fallible allocation, unlike
    /// `Clone`).
    fn copy_segment(&self, s: usize, rows: usize) -> Result<Segment> {
        let mut seg = self.new_segment()?;
        let n = rows * self.width;
        match (&mut seg, &*self.segs[s]) {
            (Segment::F32(d), Segment::F32(f)) => d[..n].copy_from_slice(&f[..n]),
            (Segment::Half(d), Segment::Half(f)) => d[..n].copy_from_slice(&f[..n]),
            _ => unreachable!("one cache, one dtype"),
        }
        Ok(seg)
    }

    /// A new cache of rows 0..rows of this one: the whole segments shared, the partial last
    /// one copied.
    pub fn share(&self, rows: usize) -> Result<CpuKv> {
        check_share(self.rows(), rows)?;
        let whole = rows >> self.shift;
        let mut segs: Vec<Arc<Segment>> = self.segs[..whole].to_vec();
        let part = rows & (self.seg_rows() - 1);
        if part > 0 {
            segs.push(Arc::new(self.copy_segment(whole, part)?));
        }
        Ok(CpuKv { segs, ..*self })
    }

    /// Private copies of the shared segments that rows row0..row0 + rows touch.
    pub fn unshare(&mut self, row0: usize, rows: usize) -> Result<()> {
        for s in touched(row0, rows, self.shift, self.segs.len()) {
            if Arc::get_mut(&mut self.segs[s]).is_none() {
                self.segs[s] = Arc::new(self.copy_segment(s, self.seg_rows())?);
            }
        }
        Ok(())
    }

    /// Each segment held, for accounting.
    pub fn segments(&self) -> Vec<KvSegment> {
        segment_list(&self.segs, (self.width * self.dtype.size()) << self.shift)
    }

    pub fn trim(&mut self, rows: usize) {
        let keep = rows.div_ceil(self.seg_rows());
        self.segs.truncate(keep);
        self.segs.shrink_to_fit();
    }

    /// Segment and element offset of row r.
    #[inline]
    fn at(&self, r: usize) -> (usize, usize) {
        (r >> self.shift, (r & (self.seg_rows() - 1)) * self.width)
    }

    /// Rows r0..r0 + n (within one segment) as f32 values, when the cache stores f32.
    #[inline]
    pub fn f32_rows(&self, r0: usize, n: usize) -> Option<&[f32]> {
        let (s, o) = self.at(r0);
        debug_assert!((r0 & (self.seg_rows() - 1)) + n <= self.seg_rows());
        match &*self.segs[s] {
            Segment::F32(v) => Some(&v[o..o + n * self.width]),
            Segment::Half(_) => None,
        }
    }

    /// Rows r0..r0 + n (within one segment) from column c0 on, as stored (f32 or 16-bit bit
    /// patterns), rows `width` values apart: what the decode kernels read in place.
    #[inline]
    pub fn block(&self, r0: usize, n: usize, c0: usize) -> KvRows<'_> {
        let (s, o) = self.at(r0);
        debug_assert!((r0 & (self.seg_rows() - 1)) + n <= self.seg_rows() && n > 0);
        let end = o + (n - 1) * self.width + self.width;
        match &*self.segs[s] {
            Segment::F32(v) => KvRows::F32(&v[o + c0..end]),
            Segment::Half(v) => KvRows::Half(self.dtype, &v[o + c0..end]),
        }
    }

    /// Columns c0..c0 + out.len() of row r, widened to f32 (inlined into the caller's
    /// multiversioned kernel, so the widening vectorizes at its ISA's width).
    #[inline(always)]
    pub fn row_f32(&self, r: usize, c0: usize, out: &mut [f32]) {
        let (s, o) = self.at(r);
        let o = o + c0;
        match &*self.segs[s] {
            Segment::F32(v) => out.copy_from_slice(&v[o..o + out.len()]),
            Segment::Half(v) => widen(self.dtype, &v[o..o + out.len()], out),
        }
    }

    /// Row r, columns c0.., from f32 values (rounded to nearest even for a 16-bit cache). The
    /// engine unshares a segment before writing it ([`CpuKv::unshare`], a fallible allocation);
    /// were it still shared here, `make_mut` would copy it, so other caches never see the write.
    #[inline]
    pub fn store_row(&mut self, r: usize, c0: usize, x: &[f32]) {
        let (s, o) = self.at(r);
        let o = o + c0;
        let dtype = self.dtype;
        match Arc::make_mut(&mut self.segs[s]) {
            Segment::F32(v) => v[o..o + x.len()].copy_from_slice(x),
            Segment::Half(v) => narrow(dtype, x, &mut v[o..o + x.len()]),
        }
    }

    /// Start fetching columns c0..c0 + n of row r into the cache (decode overlaps it with the
    /// scores of the block).
    #[inline(always)]
    pub fn prefetch_row(&self, r: usize, c0: usize, n: usize) {
        let (s, o) = self.at(r);
        match &*self.segs[s] {
            Segment::F32(v) => super::simd::prefetch(&v[o + c0..o + c0 + n]),
            Segment::Half(v) => super::simd::prefetch_bytes(bytemuck_u16(&v[o + c0..o + c0 + n])),
        }
    }

    /// Rows row0.. widened to f32 into `out` (whole rows).
    pub fn read(&self, row0: usize, out: &mut [f32]) -> Result<()> {
        check_read(self.width, self.rows(), row0, out.len())?;
        for (i, o) in out.chunks_exact_mut(self.width).enumerate() {
            self.row_f32(row0 + i, 0, o);
        }
        Ok(())
    }

    /// Rows 0..rows of `src` into self, bit for bit (segment by segment).
    pub fn copy_from(&mut self, src: &CpuKv, rows: usize) -> Result<()> {
        check_copy(
            (self.width, self.dtype, self.shift, self.rows()),
            (src.width, src.dtype, src.shift, src.rows()),
            rows,
        )?;
        for ((d, from), n) in self.segs.iter_mut().zip(&src.segs).zip(segment_rows(rows, self.shift)) {
            let n = n * self.width;
            match (Arc::make_mut(d), &**from) {
                (Segment::F32(d), Segment::F32(f)) => d[..n].copy_from_slice(&f[..n]),
                (Segment::Half(d), Segment::Half(f)) => d[..n].copy_from_slice(&f[..n]),
                _ => unreachable!("same dtype, checked above"),
            }
        }
        Ok(())
    }

    /// Bytes held, shared segments included.
    pub fn bytes(&self) -> usize {
        self.rows() * self.width * self.dtype.size()
    }
}

/// Segments of `bytes` each, held through reference counts (every backend's), as accounting
/// sees them: the allocation's address identifies a segment across the caches sharing it.
pub fn segment_list<T>(held: &[Arc<T>], bytes: usize) -> Vec<KvSegment> {
    held.iter()
        .map(|s| KvSegment {
            id: Arc::as_ptr(s) as usize,
            bytes,
            shared: Arc::strong_count(s) > 1,
        })
        .collect()
}

/// Whether a cache holding `held` rows can share its rows 0..rows.
pub fn check_share(held: usize, rows: usize) -> Result<()> {
    if rows > held {
        return Err(Error::InvalidArgument(format!(
            "kv_share of {rows} rows: the source holds {held}"
        )));
    }
    Ok(())
}

/// The segments (of 2^shift rows, `held` of them) that rows row0..row0 + rows touch.
pub fn touched(row0: usize, rows: usize, shift: u32, held: usize) -> std::ops::Range<usize> {
    if rows == 0 {
        return 0..0;
    }
    let first = (row0 >> shift).min(held);
    let end = (row0.saturating_add(rows - 1) >> shift).saturating_add(1).min(held);
    first..end
}

/// Rows 0..rows of a cache of segments of 2^shift rows, as the rows in each segment from the first:
/// what a copy of those rows moves per segment.
pub fn segment_rows(rows: usize, shift: u32) -> impl Iterator<Item = usize> {
    let seg = 1usize << shift;
    (0..rows.div_ceil(seg)).map(move |s| (rows - s * seg).min(seg))
}

/// The rows a `kv_read` of `len` values from row `row0` reads from a cache of `held` rows of
/// `width` values (every backend's check): whole rows, all of them held.
pub fn check_read(width: usize, held: usize, row0: usize, len: usize) -> Result<usize> {
    let rows = len / width.max(1);
    if len % width != 0 || row0 + rows > held {
        return Err(Error::InvalidArgument(format!(
            "kv_read: rows {row0}..{} of a cache of {held} rows of {width} values",
            row0 + rows
        )));
    }
    Ok(rows)
}

/// Whether `rows` rows can be copied between caches of (width, dtype, segment shift, rows held):
/// the same layout, and the rows in both.
pub fn check_copy(dst: (usize, KvDtype, u32, usize), src: (usize, KvDtype, u32, usize), rows: usize) -> Result<()> {
    if dst.0 != src.0 || dst.1 != src.1 || dst.2 != src.2 {
        return Err(Error::InvalidArgument(format!(
            "kv_copy between caches of different layouts: width {} / {} , {:?} / {:?}, segments of {} / {} rows",
            src.0,
            dst.0,
            src.1,
            dst.1,
            1usize << src.2,
            1usize << dst.2
        )));
    }
    if rows > src.3 || rows > dst.3 {
        return Err(Error::InvalidArgument(format!(
            "kv_copy of {rows} rows: the source holds {}, the destination {}",
            src.3, dst.3
        )));
    }
    Ok(())
}

/// 16-bit patterns of `dtype` to f32 (exact).
#[inline(always)]
pub fn widen(dtype: KvDtype, src: &[u16], dst: &mut [f32]) {
    match dtype {
        KvDtype::BF16 => {
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = f32::from_bits((s as u32) << 16);
            }
        }
        KvDtype::F16 => {
            let src: &[f16] = half::slice::HalfBitsSliceExt::reinterpret_cast(src);
            src.convert_to_f32_slice(dst);
        }
        KvDtype::F32 => unreachable!("an f32 cache has no 16-bit rows"),
    }
}

/// f32 to the 16-bit patterns of `dtype`, round to nearest even (NaN stays NaN).
#[inline]
pub fn narrow(dtype: KvDtype, src: &[f32], dst: &mut [u16]) {
    match dtype {
        KvDtype::BF16 => {
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = bf16::from_f32(s).to_bits();
            }
        }
        KvDtype::F16 => {
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = f16::from_f32(s).to_bits();
            }
        }
        KvDtype::F32 => unreachable!("an f32 cache has no 16-bit rows"),
    }
}

fn bytemuck_u16(v: &[u16]) -> &[u8] {
    // SAFETY: u16 has no padding and any byte pattern is a valid u8; the length is in bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), 2 * v.len()) }
}
