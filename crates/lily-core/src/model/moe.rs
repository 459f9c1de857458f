//! Sparse MoE block (architecture.md §7):
//!   p = softmax(router h) over all E experts; top K; weights renormalised over the K
//!   routed = sum_k w_k down_e(silu(gate_e h) * up_e h)
//!   out = routed + sigmoid(shared_expert_gate h) * down_s(silu(gate_s h) * up_s h)

use super::state::Scratch;
use crate::{
    backend::{Backend, MoeBlock, MoeExperts, MoeParams, MoeScratch, RmsNormParams, RouteParams, Router, Routing},
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

    /// The block on s.h (the normed residual, `t` tokens) and its residual add: x += moe(s.h),
    /// then s.h = rms_norm(x, w), the next block's norm (`norm`: its parameters).
    pub fn forward(&self, b: &B, t: usize, norm: &RmsNormParams, w: &B::Buf, s: &mut Scratch<B>) {
        let tokens = t as u32;
        // The router and the shared expert's gate logit read s.h together, and the routing
        // follows from the router's logits; then the routed experts and the shared one, whose
        // weighted sum goes into the residual before the next norm.
        let route = RouteParams {
            tokens,
            experts: self.experts as u32,
            top_k: self.top_k as u32,
            renorm: self.renorm as u32,
        };
        let router = Router {
            router: &self.gate,
            shared_gate: &self.shared_expert_gate,
        };
        let mut routing = Routing {
            logits: &mut s.router,
            shared: &mut s.shared_gate,
            ids: &mut s.expert_ids,
            weights: &mut s.expert_w,
        };
        b.moe_router(&route, &s.h, &router, &mut routing);
        // x += routed + sigmoid(shared_gate) shared; s.h = rms_norm(x, w).
        let moe = MoeParams {
            tokens,
            top_k: self.top_k as u32,
        };
        let block = MoeBlock {
            experts: MoeExperts {
                gate: &self.experts_gate,
                up: &self.experts_up,
                down: &self.experts_down,
                ids: &s.expert_ids,
                weights: &s.expert_w,
            },
            shared_gate: &self.shared_gate_proj,
            shared_up: &self.shared_up_proj,
            shared_down: &self.shared_down_proj,
            shared_inter: self.shared_inter as u32,
            shared_logit: &s.shared_gate,
            norm_w: w,
        };
        let mut scratch = MoeScratch {
            tmp: &mut s.moe_tmp,
            mix: &mut s.mix,
            g: &mut s.shared_g,
            u: &mut s.shared_u,
            act: &mut s.shared_act,
            y: &mut s.shared_y,
        };
        b.moe_add_rms_norm(&moe, norm, &block, &mut scratch, &mut s.x, &mut s.h);
    }
}
