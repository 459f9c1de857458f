//! Per-sequence state and the per-call scratch, allocated once when the engine is built.

use crate::{
    backend::{kv_segment_rows, Backend, KvDtype, KvSegment, OneRow},
    config::{LayerKind, ModelConfig},
    error::Result,
};

/// Attention layer: keys (after q/k-norm and RoPE) and values of every position so far, grown
/// in segments as the sequence grows.
pub struct KvCache<B: Backend> {
    pub k: B::Kv, // rows [Hkv * hd] of the cache dtype
    pub v: B::Kv, // rows [Hkv * hd] of the cache dtype
}

/// DeltaNet layer: the conv history and the recurrent state. Not positional: it cannot be
/// truncated, only snapshotted.
pub struct DeltaNetState<B: Backend> {
    pub conv: B::Buf, // [taps - 1, conv_dim] pre-conv projections, oldest first
    pub ssm: B::Buf,  // [Hv, Dk, Dv] f32
    pub conv_len: usize,
    pub ssm_len: usize,
}

pub enum LayerState<B: Backend> {
    Attention(KvCache<B>),
    DeltaNet(DeltaNetState<B>),
}

pub struct State<B: Backend> {
    pub layers: Vec<LayerState<B>>,
    /// Elements of one K (or V) row: Hkv * hd.
    pub kv_width: usize,
}

/// Elements of a DeltaNet layer's state: (conv history, recurrent state).
fn delta_net_lens(cfg: &ModelConfig) -> (usize, usize) {
    let conv = (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim();
    let ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim;
    (conv, ssm)
}

/// Values of one position's K and V in every attention layer: the KV cache grows by this many
/// elements per token.
pub fn kv_elements_per_token(cfg: &ModelConfig) -> usize {
    let attention = cfg.layer_types.iter().filter(|k| **k == LayerKind::Attention).count();
    attention * 2 * cfg.num_key_value_heads * cfg.head_dim
}

/// f32 elements of every DeltaNet layer's state together (`State::new` allocates them).
pub fn delta_net_elements(cfg: &ModelConfig) -> usize {
    let (conv, ssm) = delta_net_lens(cfg);
    cfg.layer_types.iter().filter(|k| **k == LayerKind::DeltaNet).count() * (conv + ssm)
}

impl<B: Backend> State<B> {
    /// Empty KV caches (no rows yet) of `kv_dtype` that may grow to `max_seq` rows, and zeroed
    /// DeltaNet states.
    pub fn new(b: &B, cfg: &ModelConfig, max_seq: usize, kv_dtype: KvDtype) -> Result<Self> {
        let kv_width = cfg.num_key_value_heads * cfg.head_dim;
        let layers = cfg
            .layer_types
            .iter()
            .map(|kind| {
                Ok(match kind {
                    LayerKind::Attention => LayerState::Attention(KvCache {
                        k: b.kv_new(kv_width, kv_dtype, max_seq, kv_segment_rows())?,
                        v: b.kv_new(kv_width, kv_dtype, max_seq, kv_segment_rows())?,
                    }),
                    LayerKind::DeltaNet => {
                        let (conv_len, ssm_len) = delta_net_lens(cfg);
                        LayerState::DeltaNet(DeltaNetState {
                            conv: b.alloc(conv_len)?,
                            ssm: b.alloc(ssm_len)?,
                            conv_len,
                            ssm_len,
                        })
                    }
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(State { layers, kv_width })
    }

    /// Room for `rows` KV rows in every attention layer (whole segments, allocated now).
    pub fn reserve(&mut self, b: &B, rows: usize) -> Result<()> {
        for l in &mut self.layers {
            if let LayerState::Attention(kv) = l {
                b.kv_reserve(&mut kv.k, rows)?;
                b.kv_reserve(&mut kv.v, rows)?;
            }
        }
        Ok(())
    }

    /// Before rows row0..row0 + rows are written: room for them, and a private copy of every
    /// segment they touch that a fork or a prefix-cache entry shares (copy-on-write). Allocates
    /// only for a new or a shared segment, so a warm decode step inside a segment allocates nothing.
    pub fn writable(&mut self, b: &B, row0: usize, rows: usize) -> Result<()> {
        self.reserve(b, row0.saturating_add(rows))?;
        for l in &mut self.layers {
            if let LayerState::Attention(kv) = l {
                b.kv_unshare(&mut kv.k, row0, rows)?;
                b.kv_unshare(&mut kv.v, row0, rows)?;
            }
        }
        Ok(())
    }

    /// Back to an empty sequence: DeltaNet states zeroed; the KV caches keep their first segment
    /// (the next conversation's first rows) and give the rest back. The KV rows need no clearing:
    /// attention reads only rows < position.
    pub fn reset(&mut self, b: &B) -> Result<()> {
        for l in &mut self.layers {
            match l {
                LayerState::DeltaNet(s) => {
                    b.fill_zero(&mut s.conv)?;
                    b.fill_zero(&mut s.ssm)?;
                }
                LayerState::Attention(kv) => {
                    b.kv_trim(&mut kv.k, 1);
                    b.kv_trim(&mut kv.v, 1);
                }
            }
        }
        Ok(())
    }

    /// Every KV segment held now, shared ones included (what accounting of shared memory reads).
    pub fn kv_segments(&self, b: &B) -> Vec<KvSegment> {
        let mut all = Vec::new();
        for l in &self.layers {
            if let LayerState::Attention(kv) = l {
                all.extend(b.kv_segments(&kv.k));
                all.extend(b.kv_segments(&kv.v));
            }
        }
        all
    }

    /// Bytes of KV cache held now (shared segments included).
    pub fn kv_bytes(&self, b: &B) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Attention(kv) => b.kv_bytes(&kv.k) + b.kv_bytes(&kv.v),
                LayerState::DeltaNet(_) => 0,
            })
            .sum()
    }

    /// KV rows there is room for now (the smallest over the attention layers; all grow together).
    pub fn kv_rows(&self, b: &B) -> usize {
        self.layers
            .iter()
            .filter_map(|l| match l {
                LayerState::Attention(kv) => Some(b.kv_rows(&kv.k).min(b.kv_rows(&kv.v))),
                LayerState::DeltaNet(_) => None,
            })
            .min()
            .unwrap_or(usize::MAX)
    }
}

/// Activations of one forward call of up to `chunk` tokens.
pub struct Scratch<B: Backend> {
    pub chunk: usize,
    pub ids: B::Ids,         // [chunk] token ids
    pub x: B::Buf,           // [chunk, D] residual stream
    pub h: B::Buf,           // [chunk, D] normed input of a block
    pub mix: B::Buf,         // [chunk, D] output of a block
    pub proj: B::Buf,        // [chunk, max(conv_dim, H * 2hd)] qkv (DeltaNet) or q|gate (attention)
    pub conv: B::Buf,        // [chunk, conv_dim] conv + SiLU output
    pub z: B::Buf,           // [chunk, Hv * Dv] DeltaNet output gate
    pub a: B::Buf,           // [chunk, Hv]
    pub b: B::Buf,           // [chunk, Hv]
    pub k: B::Buf,           // [chunk, Hkv * hd]
    pub v: B::Buf,           // [chunk, Hkv * hd]
    pub core: B::Buf,        // [chunk, max(Hv * Dv, H * hd)] mixer output before o_proj / out_proj
    pub gated: B::Buf,       // [chunk, Hv * Dv] gated-norm output
    pub router: B::Buf,      // [chunk, E] router logits
    pub expert_ids: B::Ids,  // [chunk, K]
    pub expert_w: B::Buf,    // [chunk, K]
    pub moe_tmp: B::Buf,     // [chunk * (K + 1), I + D]: the shared expert may run as one more pair
    pub shared_g: B::Buf,    // [chunk, Is]
    pub shared_u: B::Buf,    // [chunk, Is]
    pub shared_act: B::Buf,  // [chunk, Is]
    pub shared_y: B::Buf,    // [chunk, D]
    pub shared_gate: B::Buf, // [chunk, 1]
    pub logits: B::Buf,      // [logit_rows, V]
    pub logit_rows: usize,
}

/// Widths of the per-token scratch rows (`Scratch`'s shape comments), from the config.
struct Widths {
    d: usize,
    proj: usize,
    conv: usize,
    vd: usize,
    hv: usize,
    kv: usize,
    core: usize,
    e: usize,
    k: usize,
    i: usize,
    is: usize,
}

impl Widths {
    fn of(cfg: &ModelConfig) -> Widths {
        let vd = cfg.value_dim();
        Widths {
            d: cfg.hidden_size,
            proj: cfg.conv_dim().max(cfg.num_attention_heads * 2 * cfg.head_dim),
            conv: cfg.conv_dim(),
            vd,
            hv: cfg.linear_num_value_heads,
            kv: cfg.num_key_value_heads * cfg.head_dim,
            core: vd.max(cfg.num_attention_heads * cfg.head_dim),
            e: cfg.num_experts,
            k: cfg.num_experts_per_tok,
            i: cfg.moe_intermediate_size,
            is: cfg.shared_expert_intermediate_size,
        }
    }
}

/// 4-byte elements `Scratch::new(.., chunk, logit_rows)` allocates.
pub fn scratch_elements(cfg: &ModelConfig, chunk: usize, logit_rows: usize) -> usize {
    let w = Widths::of(cfg);
    let per_token = 1
        + 4 * w.d
        + w.proj
        + w.conv
        + 2 * w.vd
        + 2 * w.hv
        + 2 * w.kv
        + w.core
        + w.e
        + 2 * w.k
        + (w.k + 1) * (w.i + w.d)
        + 3 * w.is
        + 1;
    chunk * per_token + logit_rows * cfg.vocab_size
}

impl<B: Backend> Scratch<B> {
    pub fn new(b: &B, cfg: &ModelConfig, chunk: usize, logit_rows: usize) -> Result<Self> {
        let Widths {
            d,
            proj,
            conv,
            vd,
            hv,
            kv,
            core,
            e,
            k,
            i,
            is,
        } = Widths::of(cfg);
        Ok(Scratch {
            chunk,
            ids: b.alloc_ids(chunk)?,
            x: b.alloc(chunk * d)?,
            h: b.alloc(chunk * d)?,
            mix: b.alloc(chunk * d)?,
            proj: b.alloc(chunk * proj)?,
            conv: b.alloc(chunk * conv)?,
            z: b.alloc(chunk * vd)?,
            a: b.alloc(chunk * hv)?,
            b: b.alloc(chunk * hv)?,
            k: b.alloc(chunk * kv)?,
            v: b.alloc(chunk * kv)?,
            core: b.alloc(chunk * core)?,
            gated: b.alloc(chunk * vd)?,
            router: b.alloc(chunk * e)?,
            expert_ids: b.alloc_ids(chunk * k)?,
            expert_w: b.alloc(chunk * k)?,
            moe_tmp: b.alloc(chunk * (k + 1) * (i + d))?,
            shared_g: b.alloc(chunk * is)?,
            shared_u: b.alloc(chunk * is)?,
            shared_act: b.alloc(chunk * is)?,
            shared_y: b.alloc(chunk * d)?,
            shared_gate: b.alloc(chunk)?,
            logits: b.alloc(logit_rows * cfg.vocab_size)?,
            logit_rows,
        })
    }

    /// The activations of its first row, as the batched mixer ops' one-row scratch.
    pub fn one_row(&mut self) -> OneRow<'_, B> {
        OneRow {
            proj: &mut self.proj,
            a: &mut self.a,
            b: &mut self.b,
            k: &mut self.k,
            v: &mut self.v,
            mixed: &mut self.conv,
            core: &mut self.core,
        }
    }
}
