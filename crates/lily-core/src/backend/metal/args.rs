//! Metal-only kernel arguments, `#[repr(C)]` and mirrored by `shaders/metal/params.h` (the op
//! parameter structs themselves come from `backend/params.rs` and are bound as they are).

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

/// The bytes of a parameter struct, for `setBytes`.
///
/// Only for the `#[repr(C)]` structs of plain `u32` / `f32` fields of this module and
/// `backend/params.rs` (no padding, no pointers).
pub fn bytes_of<T: Copy>(v: &T) -> Vec<u8> {
    // SAFETY: T is one of the padding-free repr(C) parameter structs (all 4-byte fields), so
    // every byte of it is initialized.
    unsafe { std::slice::from_raw_parts(v as *const T as *const u8, size_of::<T>()) }.to_vec()
}
