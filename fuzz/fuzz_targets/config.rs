//! Any JSON as config.json: `ModelConfig::from_json` returns an error or a config whose derived
//! sizes are consistent (no panic, no wrapped arithmetic), and the same text parses the same way twice.
#![no_main]
use libfuzzer_sys::fuzz_target;
use lily_core::config::ModelConfig;

fuzz_target!(|data: &[u8]| {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    if let Ok(c) = ModelConfig::from_json(v) {
        assert_eq!(c.layer_types.len(), c.num_hidden_layers);
        let rot = c.rotary_dim();
        assert!(rot >= 2 && rot <= c.head_dim && rot % 2 == 0);
        assert!(c.num_attention_heads % c.num_key_value_heads == 0);
        assert!(c.num_experts_per_tok <= c.num_experts);
        assert!(c.rms_norm_eps > 0.0 && c.rope_theta > 1.0);
        let _ = c.conv_dim(); // checked at parse time: must not overflow here
        assert!(c.eos_token_ids.iter().all(|&t| (t as usize) < c.vocab_size));
    }
});
