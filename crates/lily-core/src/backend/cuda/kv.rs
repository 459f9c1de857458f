//! The CUDA KV cache: segments of `1 << shift` rows cuMemAlloc'd as the sequence grows, and a
//! device table of their addresses sized for `max_rows` once, so its address (what a captured
//! decode graph holds) never changes; only its entries do, written between forward calls.
//! Segments are reference-counted: a fork's table points at its source's whole segments
//! ([`Cuda::kv_share`]) until a write needs a private copy ([`Cuda::kv_unshare`]).

use std::sync::Arc;

use super::{Alloc, Cuda, Executor, KvDesc, KvElem};
use crate::{
    backend::{
        cpu::kv::{check_copy, check_read, check_share, segment_list, segment_rows, touched, widen},
        KvDtype, KvSegment,
    },
    error::{Error, Result},
};

/// One attention layer's K (or V) cache on the device.
pub struct CudaKv<X: Executor> {
    pub(crate) width: usize,
    pub(crate) dtype: KvDtype,
    shift: u32,
    max_rows: usize,
    segs: Vec<Arc<Alloc<X>>>,
    table: Alloc<X>,
}

impl<X: Executor> CudaKv<X> {
    pub fn rows(&self) -> usize {
        self.segs.len() << self.shift
    }
    pub fn bytes(&self) -> usize {
        self.rows() * self.width * self.dtype.size()
    }
    /// What the kernels are told of the cache.
    pub(crate) fn desc(&self) -> KvDesc {
        KvDesc {
            seg: self.table.ptr,
            width: self.width as u32,
            dtype: match self.dtype {
                KvDtype::F32 => KvElem::F32,
                KvDtype::BF16 => KvElem::BF16,
                KvDtype::F16 => KvElem::F16,
            } as u32,
            seg_shift: self.shift,
            pad: 0,
        }
    }
    fn seg_bytes(&self) -> usize {
        (self.width * self.dtype.size()) << self.shift
    }
}

impl<X: Executor> Cuda<X> {
    pub(super) fn kv_new(&self, width: usize, dtype: KvDtype, max_rows: usize, rows: usize) -> Result<CudaKv<X>> {
        if !rows.is_power_of_two() {
            return Err(Error::InvalidArgument(format!(
                "KV segment rows {rows}: not a power of two"
            )));
        }
        // The kernels index rows and a row's elements in 32 bits.
        rows.checked_mul(width)
            .and_then(|n| n.checked_mul(dtype.size()))
            .filter(|&n| width > 0 && u32::try_from(n).is_ok() && u32::try_from(max_rows).is_ok())
            .ok_or_else(|| Error::InvalidArgument(format!("KV row width {width} is not usable")))?;
        let entries = max_rows.div_ceil(rows).max(1);
        let table = Alloc {
            ptr: self.x.alloc(8 * entries, "kv segment table")?,
            x: self.x.clone(),
        };
        self.x.zero(table.ptr, 8 * entries)?;
        Ok(CudaKv {
            width,
            dtype,
            shift: rows.trailing_zeros(),
            max_rows,
            segs: Vec::new(),
            table,
        })
    }

    pub(super) fn kv_reserve(&self, kv: &mut CudaKv<X>, rows: usize) -> Result<()> {
        if rows > kv.max_rows {
            return Err(Error::InvalidArgument(format!(
                "KV cache asked for {rows} rows, more than its max_seq {}",
                kv.max_rows
            )));
        }
        while kv.rows() < rows {
            let seg = self.kv_segment(kv)?;
            // Between forward calls nothing in flight reads the table (every call ends in a sync).
            self.x
                .write(kv.table.ptr + 8 * kv.segs.len() as u64, &seg.ptr.to_le_bytes())?;
            kv.segs.push(seg);
        }
        Ok(())
    }

    fn kv_segment(&self, kv: &CudaKv<X>) -> Result<Arc<Alloc<X>>> {
        Ok(Arc::new(Alloc {
            ptr: self.x.alloc(kv.seg_bytes(), "kv segment")?,
            x: self.x.clone(),
        }))
    }

    /// A new cache of rows 0..rows of `src`: its table points at the whole segments of `src`,
    /// the partial last one is copied on the device (pending work first: it may write them).
    pub(super) fn kv_share(&self, src: &CudaKv<X>, rows: usize) -> Result<CudaKv<X>> {
        check_share(src.rows(), rows)?;
        self.flush()?;
        let mut dst = self.kv_new(src.width, src.dtype, src.max_rows, 1 << src.shift)?;
        let whole = rows >> src.shift;
        dst.segs = src.segs[..whole].to_vec();
        let part = rows & ((1 << src.shift) - 1);
        if part > 0 {
            let seg = self.kv_segment(src)?;
            self.x
                .copy(src.segs[whole].ptr, seg.ptr, part * src.width * src.dtype.size())?;
            dst.segs.push(seg);
        }
        let table: Vec<u8> = dst.segs.iter().flat_map(|s| s.ptr.to_le_bytes()).collect();
        if !table.is_empty() {
            self.x.write(dst.table.ptr, &table)?;
        }
        self.x.sync()?;
        Ok(dst)
    }

    /// Private copies of the shared segments rows row0..row0 + rows touch (between forward
    /// calls: nothing in flight reads the table or writes the segments).
    pub(super) fn kv_unshare(&self, kv: &mut CudaKv<X>, row0: usize, rows: usize) -> Result<()> {
        for s in touched(row0, rows, kv.shift, kv.segs.len()) {
            if Arc::get_mut(&mut kv.segs[s]).is_none() {
                self.flush()?;
                let seg = self.kv_segment(kv)?;
                self.x.copy(kv.segs[s].ptr, seg.ptr, kv.seg_bytes())?;
                self.x.write(kv.table.ptr + 8 * s as u64, &seg.ptr.to_le_bytes())?;
                self.x.sync()?;
                kv.segs[s] = seg;
            }
        }
        Ok(())
    }

    pub(super) fn kv_segments(&self, kv: &CudaKv<X>) -> Vec<KvSegment> {
        segment_list(&kv.segs, kv.seg_bytes())
    }

    pub(super) fn kv_trim(&self, kv: &mut CudaKv<X>, rows: usize) {
        let keep = rows.div_ceil(1 << kv.shift);
        if kv.segs.len() > keep {
            // Pending work may still read the segments about to be freed.
            if let Err(e) = self.flush() {
                self.fail(format!("kv_trim: {e}"));
            }
            kv.segs.truncate(keep);
        }
    }

    /// Rows 0..rows of `src` into `dst` bit for bit, one device copy per segment (pending work
    /// first: it may write the source rows).
    pub(super) fn kv_copy(&self, src: &CudaKv<X>, dst: &mut CudaKv<X>, rows: usize) -> Result<()> {
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
            self.x.copy(from.ptr, to.ptr, bytes)?;
        }
        self.x.sync()
    }

    /// Rows row0.. of `kv` widened to f32 (pending work first: it may write them).
    pub(super) fn kv_read(&self, kv: &CudaKv<X>, row0: usize, out: &mut [f32]) -> Result<()> {
        let w = kv.width;
        let rows = check_read(w, kv.rows(), row0, out.len())?;
        self.flush()?;
        let (size, mask) = (kv.dtype.size(), (1usize << kv.shift) - 1);
        let mut bytes = Vec::new();
        let mut r = row0;
        // One copy per run of rows inside one segment.
        let mut done = 0;
        while done < rows {
            let n = ((mask + 1) - (r & mask)).min(rows - done);
            bytes.resize(n * w * size, 0);
            let src = kv.segs[r >> kv.shift].ptr + ((r & mask) * w * size) as u64;
            self.x.read(src, &mut bytes)?;
            let o = &mut out[done * w..(done + n) * w];
            match kv.dtype {
                KvDtype::F32 => {
                    for (d, b) in o.iter_mut().zip(bytes.chunks_exact(4)) {
                        *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    }
                }
                d => {
                    let h: Vec<u16> = bytes
                        .chunks_exact(2)
                        .map(|b| u16::from_le_bytes([b[0], b[1]]))
                        .collect();
                    widen(d, &h, o);
                }
            }
            done += n;
            r += n;
        }
        Ok(())
    }
}
