//! Gated full attention's ops, in the order the layer runs them (architecture.md section 5):
//! - `qk_norm_rope` (`RopeParams`): per-head RMSNorm of q and k (weight 1 + w folded at load),
//!   then rotate-half RoPE on dims 0..rotary_dim at positions pos0..pos0+T, in place: q inside
//!   qg [T, H, 2 hd] (each head's first hd values; the second hd are its output gate), k
//!   [T, Hkv, hd];
//! - `kv_store` (`KvStoreParams`): cache[pos0 + t, :] = x[t, :], x [T, width], a cache of
//!   [max_seq, width] f32 rows (width = Hkv hd), one for K and one for V per attention layer;
//! - `qk_norm_rope_store` (`RopeParams`): `qk_norm_rope` then `kv_store` of k and v at pos0,
//!   fused (Metal: k normed and roped straight into its cache, one dispatch for the three);
//! - `attention` (`AttentionParams`): out [T, H hd] = softmax(q K^T scale, causal) V times
//!   sigmoid(gate), token t seeing cache rows 0..=pos0 + t; GQA: query head h reads KV head
//!   h / (H / Hkv);
//! - `qk_norm_rope_store_attention` (`RopeParams`, `AttentionParams`): `qk_norm_rope_store` then
//!   `attention`, a layer's attention core in one call (CUDA: one launch for a decode step, the
//!   attention blocks doing the norm, RoPE and store; elsewhere the two ops).

pub mod cpu;
pub mod cuda;
pub mod metal;
pub mod reference;

use crate::backend::params::{AttentionParams, RopeParams};

impl RopeParams {
    /// `attention`'s params for the tokens, position and heads of this `qk_norm_rope`, the scores
    /// scaled by 1 / sqrt(head_dim).
    pub fn attention(&self) -> AttentionParams {
        AttentionParams {
            tokens: self.tokens,
            pos0: self.pos0,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            scale: 1.0 / (self.head_dim as f32).sqrt(),
        }
    }
}
