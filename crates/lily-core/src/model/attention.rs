//! Gated full attention (architecture.md §5):
//!   [q | gate] = q_proj h (per head: 256 query values, then 256 gate values)
//!   k = k_proj h, v = v_proj h
//!   q, k <- RMSNorm(1 + w) per head, then partial rotate-half RoPE on the first rotary_dim dims
//!   append k, v to the cache; o = softmax(q K^T / sqrt(hd), causal) V with GQA (head h -> KV head h / group)
//!   out = o_proj (o * sigmoid(gate))

use super::state::{KvCache, Scratch};
use crate::{
    backend::{AttentionBatch, AttentionParams, Backend, KvSeq, MatmulParams, RopeParams},
    config::ModelConfig,
    error::Result,
    weights::Loader,
};

pub struct Attention<B: Backend> {
    q_proj: B::Matrix, // [H * 2hd, D]
    k_proj: B::Matrix, // [Hkv * hd, D]
    v_proj: B::Matrix, // [Hkv * hd, D]
    o_proj: B::Matrix, // [D, H * hd]
    q_norm: B::Buf,    // [hd] (1 + w)
    k_norm: B::Buf,    // [hd] (1 + w)
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    theta: f32,
    eps: f32,
}

impl<B: Backend> Attention<B> {
    pub fn load(b: &B, w: &Loader, i: usize, cfg: &ModelConfig) -> Result<Self> {
        let (d, h, kv, hd) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let p = |n: &str| format!("layers.{i}.self_attn.{n}");
        Ok(Attention {
            q_proj: b.upload_matrix(&w.matrix(&p("q_proj"), h * 2 * hd, d)?)?,
            k_proj: b.upload_matrix(&w.matrix(&p("k_proj"), kv * hd, d)?)?,
            v_proj: b.upload_matrix(&w.matrix(&p("v_proj"), kv * hd, d)?)?,
            o_proj: b.upload_matrix(&w.matrix(&p("o_proj"), d, h * hd)?)?,
            q_norm: b.upload(&w.norm(&p("q_norm.weight"), hd)?)?,
            k_norm: b.upload(&w.norm(&p("k_norm.weight"), hd)?)?,
            heads: h,
            kv_heads: kv,
            head_dim: hd,
            rotary_dim: cfg.rotary_dim(),
            theta: cfg.rope_theta as f32,
            eps: cfg.rms_norm_eps,
        })
    }

    /// s.mix = attention(s.h) for `t` tokens at positions pos0..pos0+t.
    pub fn forward(&self, b: &B, t: usize, pos0: usize, kv: &mut KvCache<B>, s: &mut Scratch<B>) {
        self.project(b, t, s);
        self.attend(b, t, pos0, kv, s);
        self.output(b, t, s);
    }

    /// The attention core of a batched decode step: row i of s.proj, s.k, s.v is one token of
    /// sequence i, appended to its caches at its position (`seqs[i]`); s.core gets each row's
    /// output.
    pub fn attend_batch(
        &self,
        b: &B,
        seqs: &mut [KvSeq<'_, B::Kv>],
        s: &mut Scratch<B>,
        one: &mut Scratch<B>,
    ) -> Result<()> {
        let (rope, attn) = self.params(seqs.len(), 0);
        let r = AttentionBatch {
            rope,
            attn,
            q_norm: &self.q_norm,
            k_norm: &self.k_norm,
            v: &s.v,
        };
        b.qk_norm_rope_store_attention_batch(&r, seqs, &mut s.proj, &mut s.k, &mut one.one_row(), &mut s.core)
    }

    /// s.proj = [q | gate], s.k, s.v of s.h.
    pub fn project(&self, b: &B, t: usize, s: &mut Scratch<B>) {
        let mm = MatmulParams {
            tokens: t as u32,
            x_row0: 0,
        };
        b.matmuls(
            &mm,
            &s.h,
            &[&self.q_proj, &self.k_proj, &self.v_proj],
            &mut [&mut s.proj, &mut s.k, &mut s.v],
        );
    }

    /// s.core = gated attention of s.proj over the cache, after appending s.k, s.v at pos0.
    fn attend(&self, b: &B, t: usize, pos0: usize, kv: &mut KvCache<B>, s: &mut Scratch<B>) {
        let (rope, attn) = self.params(t, pos0);
        b.qk_norm_rope_store_attention(
            &rope,
            &attn,
            &self.q_norm,
            &self.k_norm,
            &mut s.proj,
            &mut s.k,
            &s.v,
            &mut kv.k,
            &mut kv.v,
            &mut s.core,
        );
    }

    /// The norm-RoPE's and the attention's params for `t` tokens from `pos0`.
    fn params(&self, t: usize, pos0: usize) -> (RopeParams, AttentionParams) {
        let rope = RopeParams {
            tokens: t as u32,
            pos0: pos0 as u32,
            heads: self.heads as u32,
            kv_heads: self.kv_heads as u32,
            head_dim: self.head_dim as u32,
            rotary_dim: self.rotary_dim as u32,
            eps: self.eps,
            theta: self.theta,
        };
        (rope, rope.attention())
    }

    /// s.mix = o_proj s.core.
    pub fn output(&self, b: &B, t: usize, s: &mut Scratch<B>) {
        let mm = MatmulParams {
            tokens: t as u32,
            x_row0: 0,
        };
        b.matmul(&mm, &self.o_proj, &s.core, &mut s.mix);
    }
}
