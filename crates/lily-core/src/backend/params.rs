//! What the host and the kernels share, in one place: the kernel parameter structs (`#[repr(C)]`,
//! plain 32-bit fields, bound by a GPU backend as they are) and the limits and layout constants
//! both sides rely on. `shaders/params.h` is the same list for the shaders (Metal, and CUDA
//! later); a test below reads that header and checks every struct (fields, order, size) and every
//! constant against this file, so the two cannot drift.
//!
//! The op parameters come first, then the descriptors only the GPU kernels take (weight layout,
//! split and sort layouts). Shapes use the legend: T tokens in the call, D hidden size, H/Hkv
//! attention heads, Hk/Hv DeltaNet key/value heads, Dk/Dv DeltaNet head dims, E experts, K
//! experts per token, I expert width.

/// A parameter struct the kernels take by value (`setBytes`): `#[repr(C)]`, `u32` / `f32` fields
/// only, so no padding and no pointers, and at most `ParamBytes::MAX` bytes
/// (`backend/metal/args.rs`).
///
/// # Safety
/// Implement only for such structs (the [`params!`] macro does, checking the size): `bytes_of`
/// reads every byte of the value.
pub unsafe trait Param: Copy {}

/// A field type of a parameter struct: a 4-byte word, and its name in `params.h`.
trait Field {
    const C_TYPE: &'static str;
}
impl Field for u32 {
    const C_TYPE: &'static str = "uint";
}
impl Field for f32 {
    const C_TYPE: &'static str = "float";
}

/// Define `#[repr(C)]` parameter structs of `u32` / `f32` fields, each with its field list
/// (`FIELDS`, as `params.h` spells them), a compile-time check that it has no padding, and the
/// [`Param`] marker; and [`STRUCTS`], every one of them, for the check against the header.
macro_rules! params {
    ($($(#[$meta:meta])* pub struct $name:ident { $($(#[$fmeta:meta])* pub $field:ident: $ty:ty,)* })*) => {
        $(
            $(#[$meta])*
            #[repr(C)]
            #[derive(Clone, Copy, Debug, Default)]
            pub struct $name {
                $($(#[$fmeta])* pub $field: $ty,)*
            }

            impl $name {
                /// (name, C type) of each field, in order.
                pub const FIELDS: &'static [(&'static str, &'static str)] =
                    &[$((stringify!($field), <$ty as Field>::C_TYPE)),*];
            }

            // Every field is a 4-byte word (`Field`) and the struct is exactly their bytes.
            const _: () = assert!(size_of::<$name>() == 4 * $name::FIELDS.len());

            // SAFETY: repr(C), u32 / f32 fields only, no padding (both checked just above).
            unsafe impl Param for $name {}
        )*

        /// Every parameter struct: (name, size in bytes, fields).
        pub const STRUCTS: &[(&str, usize, &[(&str, &str)])] =
            &[$((stringify!($name), size_of::<$name>(), $name::FIELDS)),*];
    };
}

/// Define the shared constants and [`CONSTANTS`], every one of them with its value.
macro_rules! constants {
    ($($(#[$meta:meta])* pub const $name:ident: usize = $value:expr;)*) => {
        $($(#[$meta])* pub const $name: usize = $value;)*

        /// Every shared constant: (name, value).
        pub const CONSTANTS: &[(&str, usize)] = &[$((stringify!($name), $name)),*];
    };
}

params! {
    /// Row-wise RMSNorm over `rows` rows of `dim` values.
    pub struct RmsNormParams {
        pub rows: u32,
        pub dim: u32,
        pub eps: f32,
    }

    /// `out[t, :] = W x[x_row0 + t, :]` for t in 0..tokens (W's shape comes from the matrix).
    pub struct MatmulParams {
        pub tokens: u32,
        pub x_row0: u32,
    }

    /// Per-head RMSNorm (weight 1 + w folded in) then partial rotate-half RoPE on dims
    /// 0..rotary_dim, for q (inside the [T, H, 2*hd] q|gate projection) and k [T, Hkv, hd];
    /// positions pos0..pos0+T.
    pub struct RopeParams {
        pub tokens: u32,
        pub pos0: u32,
        pub heads: u32,
        pub kv_heads: u32,
        pub head_dim: u32,
        pub rotary_dim: u32,
        pub eps: f32,
        pub theta: f32,
    }

    /// Causal GQA attention of T new tokens against a cache of pos0 + T rows, with the sigmoid
    /// output gate. Cache rows are [Hkv, hd]; query head h reads KV head h / (H / Hkv).
    pub struct AttentionParams {
        pub tokens: u32,
        pub pos0: u32,
        pub heads: u32,
        pub kv_heads: u32,
        pub head_dim: u32,
        pub scale: f32,
    }

    /// KV-cache append: rows pos0..pos0+T of a cache of rows of `width` values (stored in
    /// segments: [`KvLayout`]).
    pub struct KvStoreParams {
        pub tokens: u32,
        pub pos0: u32,
        pub width: u32,
    }

    /// Causal depthwise conv over T tokens with `taps - 1` rows of history, then SiLU;
    /// 1 <= taps <= [`MAX_CONV_TAPS`].
    pub struct ConvParams {
        pub tokens: u32,
        pub channels: u32,
        pub taps: u32,
    }

    /// Gated DeltaNet over T tokens: input [T, 2*Hk*Dk + Hv*Dv] (q | k | v after the conv),
    /// a/b [T, Hv], state [Hv, Dk, Dv] f32.
    pub struct DeltaNetParams {
        pub tokens: u32,
        pub key_heads: u32,
        pub value_heads: u32,
        pub key_dim: u32,
        pub value_dim: u32,
    }

    /// Router: softmax over E logits, top K, optional renormalisation of the K weights.
    pub struct RouteParams {
        pub tokens: u32,
        pub experts: u32,
        pub top_k: u32,
        pub renorm: u32,
    }

    /// Routed experts: out[t] = sum_k w[t,k] * down_e(silu(gate_e x) * up_e x), e = ids[t,k].
    pub struct MoeParams {
        pub tokens: u32,
        pub top_k: u32,
    }

    /// Elementwise ops over `tokens` rows of `dim` values.
    pub struct RowsParams {
        pub tokens: u32,
        pub dim: u32,
    }

    /// A weight matrix `[experts?, rows, cols]` as the GPU kernels see it: logical row `r` of
    /// expert `e` is stored row `e * expert_stride + row_offset + r`; `group` is the quantization
    /// group (0: dense). Padded to 32 bytes.
    pub struct MatrixDesc {
        pub rows: u32,
        pub cols: u32,
        pub expert_stride: u32,
        pub row_offset: u32,
        pub group: u32,
        pub pad0: u32,
        pub pad1: u32,
        pub pad2: u32,
    }

    /// How a GPU kernel finds KV row r of a cache: in segment `r >> seg_shift` (a table of
    /// segment addresses bound beside it), at row `r & ((1 << seg_shift) - 1)` of that segment.
    pub struct KvLayout {
        pub seg_shift: u32,
        pub segments: u32,
    }

    /// Split ("flash-decoding") layout of attention: `splits` pieces of `split_rows` cache rows.
    pub struct AttentionSplit {
        pub splits: u32,
        pub split_rows: u32,
    }

    /// `embed`: T rows.
    pub struct EmbedParams {
        pub tokens: u32,
    }

    /// The expert-sorted prefill path of `moe_experts`: `experts` E, the T tokens cut into
    /// `token_blocks` sort blocks of `sort_tokens` tokens, at most `max_blocks` expert row blocks.
    pub struct MoeSortDesc {
        pub experts: u32,
        pub token_blocks: u32,
        pub sort_tokens: u32,
        pub max_blocks: u32,
    }
}

constants! {
    /// The most conv taps (`linear_conv_kernel_dim`) any kernel is asked for, checked when the
    /// config is read: `delta_net_conv` keeps the taps - 1 rows of history in registers.
    pub const MAX_CONV_TAPS: usize = 16;

    /// The longest DeltaNet key head (`Dk`) of the Metal kernels: `delta_net` keeps a state
    /// column in 8 registers per lane (Dk <= 8 x 32), the chunked prefill a [Dk, 16] block in
    /// threadgroup memory.
    pub const DELTA_NET_KEY_DIM_MAX: usize = 256;

    /// Dk and Dv at most of the CUDA `delta_net_gated` (a decode step's conv + recurrence + gated
    /// norm): its conv threads and the 4 x 32 columns and rows of a head's state in one block.
    pub const DELTA_NET_GATED_DIM_MAX: usize = 128;

    /// Conv taps at most of the CUDA `delta_net_gated` (Qwen3.6: 4): each conv thread keeps a window
    /// and weights of this many registers beside 32 state registers, under the 128-register cap of
    /// 512 threads (windows of `MAX_CONV_TAPS` spilled); more taps run the parts.
    pub const DELTA_NET_GATED_TAPS_MAX: usize = 4;

    /// Tokens per chunk of the Metal chunked DeltaNet prefill: one token per lane of a
    /// simdgroup, [32, 32] intra-chunk matrices.
    pub const DELTA_NET_CHUNK: usize = 32;

    /// Value columns of the state per threadgroup of the Metal `delta_net_chunk` kernel.
    pub const DELTA_NET_COLS: usize = 16;

    /// Rows per KV-cache segment by default (`backend::kv_segment_rows`): 1 MiB of bf16 K (or V)
    /// per segment per attention layer at Qwen3.6's 2 x 256 row width; a power of two.
    pub const KV_SEGMENT_ROWS: usize = 1024;

    /// Cache rows the Metal `attention` kernel stages in threadgroup memory per step (its two
    /// threadgroup arguments hold ATTENTION_TILE x head_dim floats each).
    pub const ATTENTION_TILE: usize = 8;

    /// The longest attention head of the Metal `attention` kernel (its K/V tiles in threadgroup
    /// memory; a lane holds head_dim / 32 values).
    pub const ATTENTION_HEAD_DIM_MAX: usize = 256;

    /// Cache rows per split of the Metal decode attention's split ("flash-decoding") layout: a
    /// single-token attention over more rows than this runs one threadgroup per (KV head, split
    /// of this many rows), each reading its rows once, then `attention_reduce`. Unsplit, a decode
    /// step has only Hkv threadgroups (2 at Qwen3.6's shapes) for the whole context, which leaves
    /// most of the GPU idle from a few thousand rows on; 256 rows keep the partials (2 + hd
    /// floats per head and split) near 3 % of the bf16 K/V they summarise.
    pub const ATTENTION_SPLIT_ROWS: usize = 256;

    /// The most splits per KV head of that layout: past ATTENTION_SPLIT_ROWS x this many rows the
    /// splits grow instead of multiplying. The partials are 2 + hd floats per query head and split,
    /// written once and read once by `attention_reduce`: at 256 rows per split that is 6.3 % of the
    /// bf16 K/V rows read (at Qwen3.6's 8 query heads per KV head of 256), which a decode step at
    /// 32K would add to its traffic; 64 splits keep it under 3.2 % there and fall with the context,
    /// while still giving 64 x Hkv threadgroups (128 at Qwen3.6's shapes, 3 per core of a 40-core GPU).
    pub const ATTENTION_MAX_SPLITS: usize = 64;

    /// Query rows per block of the CUDA prefill attention (`attention_prefill`): H / Hkv query
    /// heads of 64 / (H / Hkv) tokens, one m16 slice per warp of 4, so the block's K/V tiles serve
    /// every head of its KV head (8 tokens at Qwen3.6's 8 heads per KV head).
    pub const ATTENTION_QUERY_ROWS: usize = 64;

    /// The longest head of the Metal `qk_norm_rope` kernel (the normed head staged in
    /// threadgroup memory for the rotation).
    pub const ROPE_HEAD_DIM_MAX: usize = 1024;

    /// The most experts of the routing (`moe_route`: one key per expert in threadgroup / shared
    /// memory; CUDA's moe.cu calls it ROUTE_E_MAX) and of the expert sort (Metal `moe_scan`, CUDA
    /// `moe_sort`: one thread per expert in one threadgroup / block).
    pub const MOE_EXPERTS_MAX: usize = 1024;

    /// The most experts per token of `moe_route` (the picks kept in threadgroup / shared memory;
    /// CUDA's moe.cu calls it ROUTE_K_MAX).
    pub const ROUTE_TOP_K_MAX: usize = 64;

    /// u32 words of the Metal routing's threadgroup scratch (`route_token` in moe.metal: three
    /// per-simdgroup arrays of 32, then the picks and their probabilities).
    pub const ROUTE_TG_WORDS: usize = 3 * 32 + 2 * ROUTE_TOP_K_MAX;

    /// Token rows (and the K step) of the Metal simdgroup-matrix GEMM tiles of `matmul`.
    pub const MMA_TILE: usize = 32;

    /// Token pairs per expert block of the Metal expert-sorted MoE prefill (and the K step of its
    /// GEMMs); the weight-row side of the tiles is the `GemmTile` variant.
    pub const MOE_TILE: usize = 32;

    /// Blocks at most of the CUDA `argmax` (greedy decoding's vocabulary scan): each block scans
    /// its share of the logits and the last one to finish combines the block results, kept in
    /// the device's step buffer (2 words a block).
    pub const ARGMAX_BLOCKS: usize = 128;
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str = include_str!("../../../../shaders/params.h");

    /// The header's text with comments removed.
    fn code() -> String {
        HEADER
            .lines()
            .map(|l| l.split("//").next().unwrap_or(""))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// `struct Name { type field; ... };` of the header, in order: (name, fields).
    fn header_structs() -> Vec<(String, Vec<(String, String)>)> {
        let code = code();
        let mut out = Vec::new();
        let mut rest = code.as_str();
        while let Some(i) = rest.find("struct ") {
            rest = &rest[i + 7..];
            let open = rest.find('{').expect("struct without a body");
            let close = rest.find('}').expect("unclosed struct");
            let name = rest[..open].trim().to_string();
            let fields = rest[open + 1..close]
                .split(';')
                .map(str::trim)
                .filter(|f| !f.is_empty())
                .map(|f| {
                    let (ty, field) = f.split_once(char::is_whitespace).expect("a field is `type name`");
                    (ty.to_string(), field.trim().to_string())
                })
                .collect();
            out.push((name, fields));
            rest = &rest[close..];
        }
        out
    }

    /// `static_assert(sizeof(Name) == N, ...)` of the header: (name, N).
    fn header_sizes() -> Vec<(String, usize)> {
        code()
            .split("static_assert(sizeof(")
            .skip(1)
            .map(|s| {
                let (name, rest) = s.split_once(')').unwrap();
                let n = rest.trim_start().strip_prefix("==").unwrap();
                let n = n[..n.find(',').unwrap()].trim().parse().unwrap();
                (name.trim().to_string(), n)
            })
            .collect()
    }

    /// `LILY_CONST uint NAME = value;` of the header: (name, value).
    fn header_constants() -> Vec<(String, usize)> {
        code()
            .lines()
            .filter_map(|l| l.trim().strip_prefix("LILY_CONST uint "))
            .map(|l| {
                let (name, v) = l.split_once('=').expect("a constant has a value");
                let v = v.trim().trim_end_matches(';').trim().trim_end_matches('u');
                (name.trim().to_string(), v.parse().expect("a decimal value"))
            })
            .collect()
    }

    #[test]
    fn header_structs_match_rust() {
        let header = header_structs();
        let names: Vec<&str> = header.iter().map(|(n, _)| n.as_str()).collect();
        let rust: Vec<&str> = STRUCTS.iter().map(|s| s.0).collect();
        assert_eq!(names, rust, "the structs of params.h and params.rs, in order");
        let sizes = header_sizes();
        for ((name, fields), &(_, size, rust_fields)) in header.iter().zip(STRUCTS) {
            let want: Vec<(String, String)> = rust_fields
                .iter()
                .map(|(f, t)| (t.to_string(), f.to_string()))
                .collect();
            assert_eq!(fields, &want, "{name}: fields (C type, name) in order");
            let asserted: Vec<usize> = sizes.iter().filter(|(n, _)| n == name).map(|s| s.1).collect();
            assert_eq!(asserted, [size], "{name}: the header's static_assert of its size");
        }
        assert_eq!(sizes.len(), STRUCTS.len(), "one static_assert per struct");
    }

    #[test]
    fn header_constants_match_rust() {
        let header = header_constants();
        let rust: Vec<(String, usize)> = CONSTANTS.iter().map(|&(n, v)| (n.to_string(), v)).collect();
        assert_eq!(
            header, rust,
            "the constants of params.h and params.rs, in order, with their values"
        );
    }

    #[test]
    fn the_header_parser_sees_everything() {
        // A check that could pass on an empty parse would be no check.
        assert!(header_structs().len() >= 14 && header_constants().len() >= 10);
        assert_eq!(code().matches("struct ").count(), STRUCTS.len());
        assert_eq!(code().matches("LILY_CONST uint ").count(), CONSTANTS.len());
    }
}
