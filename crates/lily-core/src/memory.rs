//! What a model takes in memory at a given `max_seq`: its weights, the per-sequence state
//! (DeltaNet conv and recurrent states, the KV cache at `max_seq` rows in its `kv_dtype`, whole
//! segments: what it holds once the sequence reaches `max_seq`) and the activations of
//! one prefill chunk. The engine checks it against the device's limit at load (a Metal GPU's
//! `recommendedMaxWorkingSetSize`) and fits `max_seq` to it when none was asked for; `lily info`
//! prints it for a checkpoint. A backend's own scratch (attention split partials, the chunked
//! DeltaNet and sorted-MoE work areas: tens of MB at the real shapes) is not counted.

use crate::{
    backend::{kv_segment_rows, KvDtype},
    config::ModelConfig,
    model::state::{delta_net_elements, kv_elements_per_token, scratch_elements},
};

/// Bytes by use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Footprint {
    /// The tensors the model reads (`Loader::weight_bytes`).
    pub weights: u64,
    /// DeltaNet conv and recurrent states (f32).
    pub delta_net: u64,
    /// The KV cache at `max_seq` rows (rounded up to whole segments) of `kv_dtype`.
    pub kv: u64,
    pub kv_dtype: KvDtype,
    /// Activations of one forward call of `prefill_chunk` tokens and the logits rows.
    pub scratch: u64,
    pub max_seq: usize,
}

impl Footprint {
    pub fn new(
        cfg: &ModelConfig,
        weights: u64,
        max_seq: usize,
        kv_dtype: KvDtype,
        prefill_chunk: usize,
        logit_rows: usize,
    ) -> Footprint {
        let scratch = scratch_elements(cfg, prefill_chunk.min(max_seq), logit_rows);
        Footprint {
            weights,
            delta_net: delta_net_elements(cfg) as u64 * 4,
            kv: Self::kv_per_token(cfg, kv_dtype).saturating_mul(max_seq.next_multiple_of(kv_segment_rows()) as u64),
            kv_dtype,
            scratch: scratch as u64 * 4,
            max_seq,
        }
    }

    /// KV-cache bytes per token of context.
    pub fn kv_per_token(cfg: &ModelConfig, kv_dtype: KvDtype) -> u64 {
        (kv_elements_per_token(cfg) * kv_dtype.size()) as u64
    }

    pub fn total(&self) -> u64 {
        self.weights
            .saturating_add(self.delta_net)
            .saturating_add(self.kv)
            .saturating_add(self.scratch)
    }

    /// The longest context (at most `max_seq`) whose footprint fits in `limit` bytes; `None`
    /// when not even one token does (the weights and state alone are too large).
    pub fn longest_within(
        cfg: &ModelConfig,
        weights: u64,
        limit: u64,
        max_seq: usize,
        kv_dtype: KvDtype,
        prefill_chunk: usize,
        logit_rows: usize,
    ) -> Option<usize> {
        let at = |n: usize| Footprint::new(cfg, weights, n, kv_dtype, prefill_chunk, logit_rows).total();
        if at(1) > limit {
            return None;
        }
        if at(max_seq) <= limit {
            return Some(max_seq);
        }
        // The footprint grows with max_seq: the largest n with at(n) <= limit.
        let (mut lo, mut hi) = (1, max_seq);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if at(mid) <= limit {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Some(lo)
    }

    /// "19.50 GB weights + 0.06 GB DeltaNet state + 5.37 GB bf16 KV cache (262,144 tokens) +
    /// 0.10 GB activations = 25.08 GB".
    pub fn describe(&self) -> String {
        format!(
            "{} weights + {} DeltaNet state + {} {} KV cache ({} tokens) + {} activations = {}",
            gb(self.weights),
            gb(self.delta_net),
            gb(self.kv),
            self.kv_dtype.name(),
            grouped(self.max_seq as u64),
            gb(self.scratch),
            gb(self.total())
        )
    }
}

/// Bytes in GB (10^9), two decimals; in MB below 0.1 GB (a test checkpoint's sizes).
pub fn gb(bytes: u64) -> String {
    if bytes >= 100_000_000 {
        format!("{:.2} GB", bytes as f64 / 1e9)
    } else {
        format!("{:.2} MB", bytes as f64 / 1e6)
    }
}

/// 262144 -> "262,144".
pub fn grouped(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        backend::cpu::Cpu,
        model::state::{Scratch, State},
    };

    fn tiny() -> ModelConfig {
        let v = serde_json::json!({
            "model_type": "qwen3_5_moe_text", "hidden_size": 64, "num_hidden_layers": 4,
            "vocab_size": 100, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
            "full_attention_interval": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
            "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 40,
            "tie_word_embeddings": false
        });
        ModelConfig::from_json(v).unwrap()
    }

    /// The footprint counts exactly what `State::new` and `Scratch::new` allocate.
    #[test]
    fn footprint_counts_what_is_allocated() {
        let cfg = tiny();
        let cpu = Cpu::reference();
        let mut delta_net = 0;
        for l in &State::new(&cpu, &cfg, 200, KvDtype::F32).unwrap().layers {
            if let crate::model::state::LayerState::DeltaNet(s) = l {
                delta_net += s.conv.len() + s.ssm.len();
            }
        }
        // The KV cache once the sequence reaches max_seq, in each dtype.
        for dtype in [KvDtype::F32, KvDtype::BF16, KvDtype::F16] {
            let mut state = State::new(&cpu, &cfg, 200, dtype).unwrap();
            state.reserve(&cpu, 200).unwrap();
            let f = Footprint::new(&cfg, 1000, 200, dtype, 64, 16);
            assert_eq!(f.kv, state.kv_bytes(&cpu) as u64, "{dtype:?}");
        }
        let f = Footprint::new(&cfg, 1000, 200, KvDtype::BF16, 64, 16);
        assert_eq!(f.delta_net, delta_net as u64 * 4);
        let s = Scratch::new(&cpu, &cfg, 64, 16).unwrap();
        let lens = [
            s.x.len(),
            s.h.len(),
            s.mix.len(),
            s.proj.len(),
            s.conv.len(),
            s.z.len(),
            s.a.len(),
            s.b.len(),
            s.k.len(),
            s.v.len(),
            s.core.len(),
            s.gated.len(),
            s.router.len(),
            s.expert_w.len(),
            s.moe_tmp.len(),
            s.shared_g.len(),
            s.shared_u.len(),
            s.shared_act.len(),
            s.shared_y.len(),
            s.shared_gate.len(),
            s.logits.len(),
            s.ids.len(),
            s.expert_ids.len(),
        ];
        assert_eq!(f.scratch, lens.iter().sum::<usize>() as u64 * 4);
        assert_eq!(f.total(), 1000 + f.delta_net + f.kv + f.scratch);
    }

    #[test]
    fn longest_within_is_the_largest_that_fits() {
        let cfg = tiny();
        let bf16 = KvDtype::BF16;
        let at = |n| Footprint::new(&cfg, 5000, n, bf16, 64, 16).total();
        // The KV cache is allocated in whole segments: the longest max_seq ends a segment.
        let seg = kv_segment_rows();
        let limit = at(2 * seg) + 10;
        let n = Footprint::longest_within(&cfg, 5000, limit, 4 * seg, bf16, 64, 16).unwrap();
        assert_eq!(n, 2 * seg);
        assert!(at(n) <= limit && at(n + 1) > limit);
        assert_eq!(
            Footprint::longest_within(&cfg, 5000, u64::MAX, 512, bf16, 64, 16),
            Some(512)
        );
        assert_eq!(Footprint::longest_within(&cfg, 5000, 4000, 512, bf16, 64, 16), None);
        assert_eq!(grouped(262144), "262,144");
        assert_eq!(grouped(12), "12");
        assert_eq!(gb(19_500_000_000), "19.50 GB");
        assert_eq!(gb(1_234_567), "1.23 MB");
    }
}
