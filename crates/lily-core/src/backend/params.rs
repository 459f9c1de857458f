//! Kernel parameter structs: `#[repr(C)]`, plain 32-bit fields, so a GPU backend can bind them
//! as they are (`shaders/metal/params.h` mirrors this file). The op parameters first, then the
//! descriptors only the GPU kernels take (weight layout, split and sort layouts). Shapes use the legend:
//! T tokens in the call, D hidden size, H/Hkv attention heads, Hk/Hv DeltaNet key/value heads,
//! Dk/Dv DeltaNet head dims, E experts, K experts per token, I expert width.

/// Row-wise RMSNorm over `rows` rows of `dim` values.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RmsNormParams {
    pub rows: u32,
    pub dim: u32,
    pub eps: f32,
}

/// `out[t, :] = W x[x_row0 + t, :]` for t in 0..tokens (W's shape comes from the matrix).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MatmulParams {
    pub tokens: u32,
    pub x_row0: u32,
}

/// Per-head RMSNorm (weight 1 + w folded in) then partial rotate-half RoPE on dims 0..rotary_dim,
/// for q (inside the [T, H, 2*hd] q|gate projection) and k [T, Hkv, hd]; positions pos0..pos0+T.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
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
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AttentionParams {
    pub tokens: u32,
    pub pos0: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub scale: f32,
}

/// KV-cache append: rows pos0..pos0+T of a cache of [max_seq, width].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvStoreParams {
    pub tokens: u32,
    pub pos0: u32,
    pub width: u32,
}

/// The most conv taps the model may ask for (`linear_conv_kernel_dim`, checked when the config
/// is read): kernels keep the window on the stack or in registers. A backend with a smaller
/// window reports the shape as unsupported.
pub const MAX_CONV_TAPS: usize = 16;

/// Causal depthwise conv over T tokens with `taps - 1` rows of history, then SiLU.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ConvParams {
    pub tokens: u32,
    pub channels: u32,
    pub taps: u32,
}

/// Gated DeltaNet over T tokens: input [T, 2*Hk*Dk + Hv*Dv] (q | k | v after the conv),
/// a/b [T, Hv], state [Hv, Dk, Dv] f32.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DeltaNetParams {
    pub tokens: u32,
    pub key_heads: u32,
    pub value_heads: u32,
    pub key_dim: u32,
    pub value_dim: u32,
}

/// Router: softmax over E logits, top K, optional renormalisation of the K weights.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RouteParams {
    pub tokens: u32,
    pub experts: u32,
    pub top_k: u32,
    pub renorm: u32,
}

/// Routed experts: out[t] = sum_k w[t,k] * down_e(silu(gate_e x) * up_e x), e = ids[t,k].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MoeParams {
    pub tokens: u32,
    pub top_k: u32,
}

/// Elementwise ops over `tokens` rows of `dim` values.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RowsParams {
    pub tokens: u32,
    pub dim: u32,
}

/// A weight matrix `[experts?, rows, cols]` as the kernels see it: logical row `r` of expert `e`
/// is stored row `e * expert_stride + row_offset + r`; `group` is the quantization group (0: dense).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MatrixDesc {
    pub rows: u32,
    pub cols: u32,
    pub expert_stride: u32,
    pub row_offset: u32,
    pub group: u32,
    pub pad: [u32; 3],
}

/// Split ("flash-decoding") layout of attention: `splits` pieces of `split_rows` cache rows.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AttentionSplit {
    pub splits: u32,
    pub split_rows: u32,
}

/// `embed`: T rows.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EmbedParams {
    pub tokens: u32,
}

/// The expert-sorted prefill path of `moe_experts`: `experts` E, the T tokens cut into
/// `token_blocks` sort blocks of `sort_tokens` tokens, at most `max_blocks` expert row blocks.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MoeSortDesc {
    pub experts: u32,
    pub token_blocks: u32,
    pub sort_tokens: u32,
    pub max_blocks: u32,
}

const _: () = assert!(size_of::<MatrixDesc>() == 32);
const _: () = assert!(size_of::<MoeSortDesc>() == 16);
const _: () = assert!(size_of::<AttentionSplit>() == 8);
const _: () = assert!(size_of::<EmbedParams>() == 4);

/// A parameter struct the kernels take by value (`setBytes`): `#[repr(C)]`, plain `u32` / `f32`
/// fields, so no padding and no pointers, and at most `ParamBytes::MAX` bytes (`backend/metal/args.rs`).
///
/// # Safety
/// Implement only for such structs: `bytes_of` reads every byte of the value.
pub unsafe trait Param: Copy {}

macro_rules! params {
    ($($t:ty),* $(,)?) => {
        $(
            // SAFETY: repr(C) structs of u32 / f32 fields only (params.h mirrors them).
            unsafe impl Param for $t {}
        )*
    };
}

params!(
    RmsNormParams,
    MatmulParams,
    RopeParams,
    AttentionParams,
    KvStoreParams,
    ConvParams,
    DeltaNetParams,
    RouteParams,
    MoeParams,
    RowsParams,
    MatrixDesc,
    AttentionSplit,
    EmbedParams,
    MoeSortDesc,
);
