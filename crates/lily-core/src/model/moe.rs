//! Sparse MoE block (architecture.md §7):
//!   p = softmax(router h) over all E experts; top K; weights renormalised over the K
//!   routed = sum_k w_k down_e(silu(gate_e h) * up_e h)
//!   out = routed + sigmoid(shared_expert_gate h) * down_s(silu(gate_s h) * up_s h)

use super::state::Scratch;
use crate::{
    backend::{Backend, MatmulParams, MoeParams, RmsNormParams, RouteParams, RowsParams},
    config::ModelConfig,
    error::Result,
    weights::Loader,
};

pub struct Moe<B: Backend> {
    gate: B::Matrix,               // router [E, D]
    experts_gate: B::Matrix,       // [E, I, D]
    experts_up: B::Matrix,         // [E, I, D]
    experts_down: B::Matrix,       // [E, D, I]
    shared_gate_proj: B::Matrix,   // [Is, D]
    shared_up_proj: B::Matrix,     // [Is, D]
    shared_down_proj: B::Matrix,   // [D, Is]
    shared_expert_gate: B::Matrix, // [1, D]
    experts: usize,
    top_k: usize,
    renorm: bool,
    shared_inter: usize,
}

impl<B: Backend> Moe<B> {
    pub fn load(b: &B, w: &Loader, i: usize, cfg: &ModelConfig) -> Result<Self> {
        let (d, e, is) = (cfg.hidden_size, cfg.num_experts, cfg.shared_expert_intermediate_size);
        let p = |n: &str| format!("layers.{i}.mlp.{n}");
        let (eg, eu, ed) = w.experts(i)?;
        Ok(Moe {
            gate: b.upload_matrix(&w.matrix(&p("gate"), e, d)?)?,
            experts_gate: b.upload_matrix(&eg)?,
            experts_up: b.upload_matrix(&eu)?,
            experts_down: b.upload_matrix(&ed)?,
            shared_gate_proj: b.upload_matrix(&w.matrix(&p("shared_expert.gate_proj"), is, d)?)?,
            shared_up_proj: b.upload_matrix(&w.matrix(&p("shared_expert.up_proj"), is, d)?)?,
            shared_down_proj: b.upload_matrix(&w.matrix(&p("shared_expert.down_proj"), d, is)?)?,
            shared_expert_gate: b.upload_matrix(&w.matrix(&p("shared_expert_gate"), 1, d)?)?,
            experts: e,
            top_k: cfg.num_experts_per_tok,
            renorm: cfg.norm_topk_prob,
            shared_inter: is,
        })
    }

    /// The MoE of s.h for `t` tokens, in parts: s.mix = the routed experts' weighted sum,
    /// s.shared_y = the shared expert, s.shared_gate = its gate logit (`add_norm` combines them).
    pub fn forward(&self, b: &B, t: usize, s: &mut Scratch<B>) {
        let mm = MatmulParams {
            tokens: t as u32,
            x_row0: 0,
        };
        // The router and the shared expert's gate logit read s.h together; the shared expert's
        // input half is one op: silu(gate_s h) * up_s h.
        b.matmuls(
            &mm,
            &s.h,
            &[&self.gate, &self.shared_expert_gate],
            &mut [&mut s.router, &mut s.shared_gate],
        );
        let shared = RowsParams {
            tokens: t as u32,
            dim: self.shared_inter as u32,
        };
        b.gate_up_swiglu(
            &shared,
            &self.shared_gate_proj,
            &self.shared_up_proj,
            &s.h,
            &mut s.shared_g,
            &mut s.shared_u,
            &mut s.shared_act,
        );
        let route = RouteParams {
            tokens: t as u32,
            experts: self.experts as u32,
            top_k: self.top_k as u32,
            renorm: self.renorm as u32,
        };
        b.moe_route(&route, &s.router, &mut s.expert_ids, &mut s.expert_w);
        let moe = MoeParams {
            tokens: t as u32,
            top_k: self.top_k as u32,
        };
        b.moe_experts(
            &moe,
            &s.h,
            &s.expert_ids,
            &s.expert_w,
            &self.experts_gate,
            &self.experts_up,
            &self.experts_down,
            &mut s.moe_tmp,
            &mut s.mix,
        );
        b.matmul(&mm, &self.shared_down_proj, &s.shared_act, &mut s.shared_y);
    }

    /// x += the block's output (s.mix + sigmoid(s.shared_gate) s.shared_y, after `forward`), then
    /// s.h = rms_norm(x, w): the residual add and the norm after it, fused.
    pub fn add_norm(&self, b: &B, p: &RmsNormParams, w: &B::Buf, s: &mut Scratch<B>) {
        b.add_gated_rms_norm(p, &mut s.x, &s.mix, &s.shared_y, &s.shared_gate, w, &mut s.h);
    }
}
