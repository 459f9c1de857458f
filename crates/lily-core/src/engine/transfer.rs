//! A sequence's whole state read out to host memory and written back into a sequence: what the
//! prefix cache's disk tier stores, and what carries a conversation into another process.
//!
//! Only memory ops every backend has are used (`kv_read`, `read`, `upload`, `kv_store`, `copy`),
//! so every backend exports and imports. K/V rows come back widened to f32 and are narrowed here
//! to the cache dtype, which is exact (they were of that dtype); on import they go back through
//! `kv_store`, whose rounding leaves a value of the cache dtype unchanged. The rows written are
//! bit for bit those read, and the DeltaNet states are f32 copies.

use half::f16;

use super::{seq_mut, Runner, SeqId};
use crate::{
    backend::{params::KvStoreParams, Backend, KvDtype, StreamKind},
    error::{Error, Result},
    model::state::LayerState,
};

/// Rows moved per `kv_read` / `kv_store`: bounds the f32 staging memory whatever the position.
const ROWS_PER_PASS: usize = 4096;

/// The token of a KV row that no token wrote (`fill_context`): matches no prompt.
const NO_TOKEN: u32 = u32::MAX;

/// One sequence's state at its position, in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct SequenceState {
    /// The tokens behind KV rows 0..position (the position is their count).
    pub tokens: Vec<u32>,
    /// The first K/V row held below: 0 for a whole state (the only kind an import takes); more
    /// for the rows a stored earlier state of the same tokens lacks (the prefix cache's disk tier
    /// writes only those).
    pub first_row: usize,
    /// Element type of the K/V rows below.
    pub kv_dtype: KvDtype,
    /// One entry per layer of the model, in order.
    pub layers: Vec<LayerData>,
}

/// One layer's part of a [`SequenceState`].
#[derive(Clone, Debug, PartialEq)]
pub enum LayerData {
    /// K and V rows first_row..position, each [position - first_row, Hkv * hd] values of the
    /// cache dtype as little-endian bytes.
    Attention { k: Vec<u8>, v: Vec<u8> },
    /// The conv history [taps - 1, conv_dim] and the recurrent state [Hv, Dk, Dv], f32.
    DeltaNet { conv: Vec<f32>, ssm: Vec<f32> },
}

impl SequenceState {
    pub fn position(&self) -> usize {
        self.tokens.len()
    }
}

impl<B: Backend> Runner<B> {
    pub(super) fn export(&self, id: SeqId, first_row: usize) -> Result<SequenceState> {
        self.trusted(id)?;
        let seq = self.seq(id)?;
        let (pos, width) = (seq.pos, seq.state.kv_width);
        if first_row > pos {
            return Err(Error::InvalidArgument(format!(
                "first_row {first_row} is past the sequence's position {pos}"
            )));
        }
        let mut staging = vec![0f32; ROWS_PER_PASS.min(pos.max(1)) * width];
        let mut read_rows = |kv: &B::Kv| -> Result<Vec<u8>> {
            let mut out = Vec::with_capacity((pos - first_row) * width * self.kv_dtype.size());
            for row0 in (first_row..pos).step_by(ROWS_PER_PASS) {
                let rows = ROWS_PER_PASS.min(pos - row0);
                let buf = &mut staging[..rows * width];
                self.b.kv_read(kv, row0, buf)?;
                narrow(self.kv_dtype, buf, &mut out);
            }
            Ok(out)
        };
        let mut layers = Vec::with_capacity(seq.state.layers.len());
        for layer in &seq.state.layers {
            layers.push(match layer {
                LayerState::Attention(kv) => LayerData::Attention {
                    k: read_rows(&kv.k)?,
                    v: read_rows(&kv.v)?,
                },
                LayerState::DeltaNet(s) => {
                    let mut conv = vec![0f32; s.conv_len];
                    let mut ssm = vec![0f32; s.ssm_len];
                    self.b.read(&s.conv, 0, &mut conv)?;
                    self.b.read(&s.ssm, 0, &mut ssm)?;
                    LayerData::DeltaNet { conv, ssm }
                }
            });
        }
        Ok(SequenceState {
            tokens: seq.cached[..pos].to_vec(),
            first_row,
            kv_dtype: self.kv_dtype,
            layers,
        })
    }

    /// Sequence `id` becomes `st` (what it held before is gone). Everything is checked first: on
    /// an error other than a device error the sequence is as it was.
    pub(super) fn import(&mut self, id: SeqId, st: &SequenceState) -> Result<()> {
        self.seq(id)?;
        self.check_import(st)?;
        let r = self.write_state(id, st);
        self.guard([id], r)?;
        let seq = seq_mut(&mut self.seqs, id)?;
        seq.pos = st.position();
        seq.cached.clear();
        seq.cached.extend_from_slice(&st.tokens);
        seq.error = None;
        Ok(())
    }

    fn check_import(&self, st: &SequenceState) -> Result<()> {
        let bad = |what: String| {
            Err(Error::InvalidArgument(format!(
                "sequence state does not fit this engine: {what}"
            )))
        };
        let pos = st.position();
        if st.first_row != 0 {
            return bad(format!("it holds K/V rows from {} on, not a whole state", st.first_row));
        }
        if st.kv_dtype != self.kv_dtype {
            return bad(format!(
                "its KV rows are {}, this engine's cache is {}",
                st.kv_dtype.name(),
                self.kv_dtype.name()
            ));
        }
        if pos > self.max_seq {
            return bad(format!("position {pos} is past max_seq {}", self.max_seq));
        }
        let vocab = self.model.vocab();
        if let Some(&t) = st.tokens.iter().find(|&&t| t as usize >= vocab && t != NO_TOKEN) {
            return Err(Error::InvalidToken { token: t, vocab });
        }
        let ours = &self.seq(super::DEFAULT_SEQ)?.state;
        if st.layers.len() != ours.layers.len() {
            return bad(format!(
                "{} layers, the model has {}",
                st.layers.len(),
                ours.layers.len()
            ));
        }
        let width = ours.kv_width;
        let kv_len = pos * width * self.kv_dtype.size();
        for (i, (theirs, ours)) in st.layers.iter().zip(&ours.layers).enumerate() {
            match (theirs, ours) {
                (LayerData::Attention { k, v }, LayerState::Attention(_)) => {
                    if k.len() != kv_len || v.len() != kv_len {
                        return bad(format!(
                            "layer {i}: K/V of {} / {} bytes, expected {kv_len} ({pos} rows of {} {} values)",
                            k.len(),
                            v.len(),
                            width,
                            self.kv_dtype.name()
                        ));
                    }
                }
                (LayerData::DeltaNet { conv, ssm }, LayerState::DeltaNet(s)) => {
                    if conv.len() != s.conv_len || ssm.len() != s.ssm_len {
                        return bad(format!(
                            "layer {i}: DeltaNet conv / recurrent state of {} / {} values, expected {} / {}",
                            conv.len(),
                            ssm.len(),
                            s.conv_len,
                            s.ssm_len
                        ));
                    }
                }
                (LayerData::Attention { .. }, _) => {
                    return bad(format!("layer {i} is attention, the model's is DeltaNet"))
                }
                (LayerData::DeltaNet { .. }, _) => {
                    return bad(format!("layer {i} is DeltaNet, the model's is attention"))
                }
            }
        }
        Ok(())
    }

    /// Reserve `st`'s rows (segment-wise, and give back those past them), write its K/V rows and
    /// DeltaNet states.
    fn write_state(&mut self, id: SeqId, st: &SequenceState) -> Result<()> {
        let pos = st.position();
        let dtype = self.kv_dtype;
        let seq = seq_mut(&mut self.seqs, id)?;
        let width = seq.state.kv_width;
        // Rows 0..pos are rewritten: segments shared with a fork are copied first, not overwritten.
        seq.state.writable(&self.b, 0, pos.max(1))?;
        for l in seq.state.layers.iter_mut() {
            if let LayerState::Attention(kv) = l {
                self.b.kv_trim(&mut kv.k, pos.max(1));
                self.b.kv_trim(&mut kv.v, pos.max(1));
            }
        }
        let mut staging = vec![0f32; ROWS_PER_PASS.min(pos.max(1)) * width];
        let row_bytes = width * dtype.size();
        for row0 in (0..pos).step_by(ROWS_PER_PASS) {
            let rows = ROWS_PER_PASS.min(pos - row0);
            let p = KvStoreParams {
                tokens: rows as u32,
                pos0: row0 as u32,
                width: width as u32,
            };
            for (data, layer) in st.layers.iter().zip(seq.state.layers.iter_mut()) {
                if let (LayerData::Attention { k, v }, LayerState::Attention(kv)) = (data, layer) {
                    for (src, dst) in [(k, &mut kv.k), (v, &mut kv.v)] {
                        let buf = &mut staging[..rows * width];
                        widen(dtype, &src[row0 * row_bytes..(row0 + rows) * row_bytes], buf);
                        let up = self.b.upload(buf)?;
                        self.b.begin(StreamKind::Other)?;
                        self.b.kv_store(&p, &up, dst);
                        self.b.finish()?;
                    }
                }
            }
        }
        let mut uploads = Vec::new();
        for data in &st.layers {
            if let LayerData::DeltaNet { conv, ssm } = data {
                uploads.push(self.b.upload(conv)?);
                uploads.push(self.b.upload(ssm)?);
            }
        }
        let mut up = uploads.iter();
        self.b.begin(StreamKind::Other)?;
        for layer in seq.state.layers.iter_mut() {
            if let LayerState::DeltaNet(s) = layer {
                for (dst, len) in [(&mut s.conv, s.conv_len), (&mut s.ssm, s.ssm_len)] {
                    if let Some(src) = up.next() {
                        self.b.copy(src, dst, len)?;
                    }
                }
            }
        }
        self.b.finish()
    }
}

/// f32 values (each exactly a value of `dtype`) appended to `out` as `dtype`'s little-endian bytes.
fn narrow(dtype: KvDtype, src: &[f32], out: &mut Vec<u8>) {
    match dtype {
        KvDtype::F32 => src.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        KvDtype::BF16 => src
            .iter()
            .for_each(|x| out.extend_from_slice(&((x.to_bits() >> 16) as u16).to_le_bytes())),
        KvDtype::F16 => src
            .iter()
            .for_each(|x| out.extend_from_slice(&f16::from_f32(*x).to_bits().to_le_bytes())),
    }
}

/// `dtype`'s little-endian bytes to f32 values (exact); `src` holds `out.len()` values.
fn widen(dtype: KvDtype, src: &[u8], out: &mut [f32]) {
    match dtype {
        KvDtype::F32 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        KvDtype::BF16 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
            }
        }
        KvDtype::F16 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every 16-bit pattern (but NaNs, whose payload f16 may quieten) survives widen + narrow, and
    /// `kv_store`'s rounding (the CPU's `narrow`) of a widened value gives the pattern back.
    #[test]
    fn sixteen_bit_patterns_survive_the_round_trip() {
        for dtype in [KvDtype::BF16, KvDtype::F16] {
            let bits: Vec<u16> = (0..=u16::MAX).collect();
            let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
            let mut wide = vec![0f32; bits.len()];
            widen(dtype, &bytes, &mut wide);
            let mut back = Vec::new();
            narrow(dtype, &wide, &mut back);
            let mut stored = vec![0u16; bits.len()];
            crate::backend::cpu::kv::narrow(dtype, &wide, &mut stored);
            for (i, &b) in bits.iter().enumerate() {
                if !wide[i].is_nan() {
                    assert_eq!(
                        u16::from_le_bytes([back[2 * i], back[2 * i + 1]]),
                        b,
                        "{dtype:?} {b:#06x}"
                    );
                    assert_eq!(stored[i], b, "{dtype:?} {b:#06x} through kv_store's rounding");
                }
            }
        }
    }
}
