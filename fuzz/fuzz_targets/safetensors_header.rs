//! Any bytes as a safetensors header over a data region of any size: `parse_header` returns an
//! error or entries that tile the region exactly (sorted, no overlap, no gap), never panics.
#![no_main]
use libfuzzer_sys::fuzz_target;
use lily_core::safetensors::parse_header;

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let data_len = u32::from_le_bytes(data[..4].try_into().unwrap()) as usize;
    if let Ok(entries) = parse_header(&data[4..], data_len) {
        let mut at = 0;
        for e in &entries {
            assert_eq!(e.begin, at, "{e:?}");
            assert!(e.end >= e.begin && e.end <= data_len);
            at = e.end;
        }
        assert_eq!(at, data_len);
    }
});
