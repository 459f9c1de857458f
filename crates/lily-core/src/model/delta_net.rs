//! Gated DeltaNet (architecture.md §6):
//!   mixed = in_proj_qkv h = [q | k | v]; z = in_proj_z h; b = in_proj_b h; a = in_proj_a h
//!   [q | k | v] <- silu(causal depthwise conv(mixed))          (conv state: last taps-1 inputs)
//!   q <- l2norm(q) / sqrt(Dk); k <- l2norm(k); beta = sigmoid(b); g = -exp(A_log) softplus(a + dt_bias)
//!   per value head (q/k head = j / (Hv/Hk)): S <- e^g S; S <- S + k (beta (v - S^T k))^T; o = S^T q
//!   out = out_proj (RMSNorm(o) * w * silu(z)) per value head

use super::state::{DeltaNetState, Scratch};
use crate::{
    backend::{
        Backend, ConvParams, DeltaNetGated, DeltaNetOps, DeltaNetParams, DeltaNetSeq, MatmulParams, RmsNormParams,
    },
    config::ModelConfig,
    error::Result,
    weights::Loader,
};

pub struct DeltaNet<B: Backend> {
    in_proj_qkv: B::Matrix, // [2 Hk Dk + Hv Dv, D]
    in_proj_z: B::Matrix,   // [Hv Dv, D]
    in_proj_b: B::Matrix,   // [Hv, D]
    in_proj_a: B::Matrix,   // [Hv, D]
    conv1d: B::Buf,         // [conv_dim, taps]
    a_log: B::Buf,          // [Hv] f32
    dt_bias: B::Buf,        // [Hv]
    norm: B::Buf,           // [Dv] plain weight (not 1 + w)
    out_proj: B::Matrix,    // [D, Hv Dv]
    dims: DeltaNetParams,
    taps: usize,
    eps: f32,
}

impl<B: Backend> DeltaNet<B> {
    pub fn load(b: &B, w: &Loader, i: usize, cfg: &ModelConfig) -> Result<Self> {
        let d = cfg.hidden_size;
        let (hv, taps) = (cfg.linear_num_value_heads, cfg.linear_conv_kernel_dim);
        let p = |n: &str| format!("layers.{i}.linear_attn.{n}");
        Ok(DeltaNet {
            in_proj_qkv: b.upload_matrix(&w.matrix(&p("in_proj_qkv"), cfg.conv_dim(), d)?)?,
            in_proj_z: b.upload_matrix(&w.matrix(&p("in_proj_z"), cfg.value_dim(), d)?)?,
            in_proj_b: b.upload_matrix(&w.matrix(&p("in_proj_b"), hv, d)?)?,
            in_proj_a: b.upload_matrix(&w.matrix(&p("in_proj_a"), hv, d)?)?,
            conv1d: b.upload(&w.conv(&p("conv1d.weight"), cfg.conv_dim(), taps)?)?,
            a_log: b.upload(&w.vector(&p("A_log"), hv)?)?,
            dt_bias: b.upload(&w.vector(&p("dt_bias"), hv)?)?,
            norm: b.upload(&w.vector(&p("norm.weight"), cfg.linear_value_head_dim)?)?,
            out_proj: b.upload_matrix(&w.matrix(&p("out_proj"), d, cfg.value_dim())?)?,
            dims: DeltaNetParams {
                tokens: 0,
                key_heads: cfg.linear_num_key_heads as u32,
                value_heads: hv as u32,
                key_dim: cfg.linear_key_head_dim as u32,
                value_dim: cfg.linear_value_head_dim as u32,
            },
            taps,
            eps: cfg.rms_norm_eps,
        })
    }

    /// s.mix = delta_net(s.h) for `t` tokens, advancing the conv and recurrent state.
    pub fn forward(&self, b: &B, t: usize, st: &mut DeltaNetState<B>, s: &mut Scratch<B>) {
        self.project(b, t, s);
        // s.gated = gated norm of the recurrence's output of the conv of s.proj, by s.z
        let r = DeltaNetGated {
            ops: self.ops(t, [&s.proj, &s.a, &s.b]),
            norm: self.norm_params(t),
            norm_w: &self.norm,
            z: &s.z,
        };
        b.delta_net_gated(&r, &mut st.conv, &mut st.ssm, &mut s.conv, &mut s.core, &mut s.gated);
        self.out_proj(b, t, s);
    }

    /// The conv and the recurrence of a batched decode step: row i of s.proj, s.a, s.b is one
    /// token of sequence i, on its states `seqs[i]`; s.core gets each row's output.
    pub fn recur_batch(
        &self,
        b: &B,
        seqs: &mut [DeltaNetSeq<'_, B::Buf>],
        s: &mut Scratch<B>,
        one: &mut Scratch<B>,
    ) -> Result<()> {
        let r = self.ops(seqs.len(), [&s.proj, &s.a, &s.b]);
        b.delta_net_batch(&r, seqs, &mut one.one_row(), &mut s.conv, &mut s.core)
    }

    /// The conv's and the recurrence's operands for `t` tokens (rows) of the projections proj, a,
    /// b (the scratch's).
    fn ops<'a>(&'a self, t: usize, [proj, a, b]: [&'a B::Buf; 3]) -> DeltaNetOps<'a, B> {
        DeltaNetOps {
            conv: self.conv_params(t),
            delta: self.delta_params(t),
            conv1d: &self.conv1d,
            a_log: &self.a_log,
            dt_bias: &self.dt_bias,
            proj,
            a,
            b,
        }
    }

    fn conv_dim(&self) -> u32 {
        2 * self.dims.key_heads * self.dims.key_dim + self.dims.value_heads * self.dims.value_dim
    }

    /// s.proj = [q | k | v], s.z, s.b, s.a of s.h.
    pub fn project(&self, b: &B, t: usize, s: &mut Scratch<B>) {
        let mm = MatmulParams {
            tokens: t as u32,
            x_row0: 0,
        };
        b.matmuls(
            &mm,
            &s.h,
            &[&self.in_proj_qkv, &self.in_proj_z, &self.in_proj_b, &self.in_proj_a],
            &mut [&mut s.proj, &mut s.z, &mut s.b, &mut s.a],
        );
    }

    /// s.mix = out_proj(gated norm of s.core by s.z).
    pub fn output(&self, b: &B, t: usize, s: &mut Scratch<B>) {
        b.rms_norm_gated(&self.norm_params(t), &s.core, &s.z, &self.norm, &mut s.gated);
        self.out_proj(b, t, s);
    }

    /// s.mix = out_proj(s.gated).
    fn out_proj(&self, b: &B, t: usize, s: &mut Scratch<B>) {
        let mm = MatmulParams {
            tokens: t as u32,
            x_row0: 0,
        };
        b.matmul(&mm, &self.out_proj, &s.gated, &mut s.mix);
    }

    /// The conv over `t` tokens of [q | k | v].
    fn conv_params(&self, t: usize) -> ConvParams {
        ConvParams {
            tokens: t as u32,
            channels: self.conv_dim(),
            taps: self.taps as u32,
        }
    }

    /// The recurrence over `t` tokens.
    fn delta_params(&self, t: usize) -> DeltaNetParams {
        DeltaNetParams {
            tokens: t as u32,
            ..self.dims
        }
    }

    /// The output norm: per value head of `t` tokens.
    fn norm_params(&self, t: usize) -> RmsNormParams {
        RmsNormParams {
            rows: t as u32 * self.dims.value_heads,
            dim: self.dims.value_dim,
            eps: self.eps,
        }
    }
}
