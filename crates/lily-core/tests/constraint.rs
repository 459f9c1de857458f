//! Structured output: llguidance masks over a small byte-level vocabulary, through the sampler.

use lily_core::{
    constraint::{allowed, GrammarKind, Vocab},
    sampling::{Sampler, SamplingParams},
};

const EOS: u32 = 258;

/// Ids 0..256 are single bytes, 256 is "true", 257 is `{"`, 258 is the end-of-sequence id
/// (special), 259 the padding row past the tokenizer.
fn vocab() -> Vocab {
    let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    tokens.push(b"true".to_vec());
    tokens.push(b"{\"".to_vec());
    tokens.push(b"<|end|>".to_vec());
    Vocab::new(&tokens, &[EOS], &[EOS], 260).unwrap()
}

/// Random logits, so anything unconstrained would be noise.
fn logits(seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..260)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 2000) as f32 / 100.0
        })
        .collect()
}

/// Generates under `source` until the end-of-sequence id; the text.
fn generate(kind: GrammarKind, source: &str, seed: u64) -> String {
    let vocab = vocab();
    let mut c = vocab.constrain(kind, source).unwrap();
    let params = SamplingParams {
        vocab_limit: Some(259),
        ..Default::default()
    };
    let mut s = Sampler::new(params, seed).unwrap();
    let mut out = Vec::new();
    for step in 0..400u64 {
        let mask = c.mask().unwrap().to_vec();
        let t = s
            .sample_allowed(&logits(seed * 1000 + step), Some(&mask), false)
            .unwrap()
            .token;
        assert!(allowed(&mask, t));
        c.commit(t).unwrap();
        match t {
            EOS => return String::from_utf8(out).unwrap(),
            256 => out.extend_from_slice(b"true"),
            257 => out.extend_from_slice(b"{\""),
            b => out.push(b as u8),
        }
    }
    panic!("no end after 400 tokens: {:?}", String::from_utf8_lossy(&out));
}

#[test]
fn json_schema_output_parses_and_follows_the_schema() {
    let schema = r#"{"type": "object", "properties": {"ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["ok", "n"],
        "additionalProperties": false, "x-guidance": {"whitespace_flexible": false}}"#;
    for seed in 1..20 {
        let text = generate(GrammarKind::JsonSchema, schema, seed);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(
            v["ok"].is_boolean() && v["n"].as_u64().is_some_and(|n| n <= 9),
            "{text}"
        );
        assert_eq!(v.as_object().unwrap().len(), 2, "{text}");
    }
}

#[test]
fn regex_and_lark_outputs_match() {
    for seed in 1..10 {
        let date = generate(GrammarKind::Regex, "[0-9]{4}-[0-9]{2}-[0-9]{2}", seed);
        assert!(
            date.len() == 10 && date.as_bytes()[4] == b'-' && date.as_bytes()[7] == b'-',
            "{date}"
        );
        let yes_no = generate(GrammarKind::Lark, "start: (\"yes\" | \"no\") \"!\"", seed);
        assert!(yes_no == "yes!" || yes_no == "no!", "{yes_no}");
    }
}

#[test]
fn a_bad_grammar_is_an_error_naming_it() {
    let vocab = vocab();
    for (kind, src) in [
        (GrammarKind::JsonSchema, "{not json"),
        (GrammarKind::JsonSchema, r#"{"type": "nonsense"}"#),
        (GrammarKind::Lark, "start: undefined_rule"),
        (GrammarKind::Regex, "(unclosed"),
    ] {
        let err = vocab
            .constrain(kind, src)
            .err()
            .unwrap_or_else(|| panic!("{src} compiled"));
        assert!(err.to_string().contains("grammar"), "{err}");
    }
    assert!(GrammarKind::parse("yaml").is_err());
}

#[test]
fn committing_a_forbidden_token_is_an_error() {
    let vocab = vocab();
    let mut c = vocab.constrain(GrammarKind::Regex, "[0-9]+").unwrap();
    assert!(!allowed(c.mask().unwrap(), b'a' as u32));
    assert!(c.commit(b'a' as u32).is_err());
    let mut c = vocab.constrain(GrammarKind::Regex, "[0-9]").unwrap();
    c.commit(b'7' as u32).unwrap();
    let done = c.mask().unwrap();
    assert!(
        allowed(done, EOS) && !allowed(done, b'8' as u32),
        "a complete grammar allows only the end"
    );
}

#[test]
fn bad_token_tables_are_errors() {
    assert!(Vocab::new(&[], &[], &[0], 10).is_err());
    assert!(Vocab::new(&[b"a".to_vec()], &[], &[], 10).is_err());
    assert!(Vocab::new(&[b"a".to_vec()], &[], &[5], 10).is_err());
    assert!(Vocab::new(&[b"a".to_vec(), b"b".to_vec()], &[], &[1], 1).is_err());
    // Duplicate bytes: the second id is never allowed, and nothing panics.
    let v = Vocab::new(&[b"a".to_vec(), b"a".to_vec(), b"".to_vec()], &[2], &[2], 3).unwrap();
    let mut c = v.constrain(GrammarKind::Regex, "a+").unwrap();
    let m = c.mask().unwrap();
    assert!(allowed(m, 0) && !allowed(m, 1));
}
