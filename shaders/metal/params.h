// Kernel parameter structs, mirrored by hand from crates/lily-core/src/backend/params.rs
// (the op params) and backend/metal/args.rs (the Metal-only descriptors). Plain 32-bit fields;
// both sides assert the sizes. Legend: T tokens, D hidden, H/Hkv attention heads, Hk/Hv DeltaNet
// key/value heads, Dk/Dv their head dims, E experts, K experts per token, I expert width.
#pragma once

struct RmsNormParams { uint rows; uint dim; float eps; };
struct MatmulParams { uint tokens; uint x_row0; };
struct RopeParams {
  uint tokens; uint pos0; uint heads; uint kv_heads; uint head_dim; uint rotary_dim; float eps; float theta;
};
struct AttentionParams { uint tokens; uint pos0; uint heads; uint kv_heads; uint head_dim; float scale; };
struct KvStoreParams { uint tokens; uint pos0; uint width; };
struct ConvParams { uint tokens; uint channels; uint taps; };
struct DeltaNetParams { uint tokens; uint key_heads; uint value_heads; uint key_dim; uint value_dim; };
struct RouteParams { uint tokens; uint experts; uint top_k; uint renorm; };
struct MoeParams { uint tokens; uint top_k; };
struct RowsParams { uint tokens; uint dim; };

// Metal-only descriptors (backend/metal/args.rs).
// A weight matrix [experts?, rows, cols]: logical row r of expert e is stored row
// e * expert_stride + row_offset + r; `group` = quantization group size (0 for dense).
struct MatrixDesc { uint rows; uint cols; uint expert_stride; uint row_offset; uint group; uint pad0; uint pad1; uint pad2; };
// Split ("flash-decoding") layout: the causal range of each query is cut into `splits` pieces of
// `split_rows` cache rows; splits == 1 writes the final output directly.
struct AttentionSplit { uint splits; uint split_rows; };
// embed: T rows.
struct EmbedParams { uint tokens; };
// The expert-sorted prefill path of moe_experts (moe.metal): E experts, the T tokens cut into
// `token_blocks` sort blocks of `sort_tokens` tokens, at most `max_blocks` expert row blocks.
struct MoeSortDesc { uint experts; uint token_blocks; uint sort_tokens; uint max_blocks; };

static_assert(sizeof(RmsNormParams) == 12, "RmsNormParams");
static_assert(sizeof(MatmulParams) == 8, "MatmulParams");
static_assert(sizeof(RopeParams) == 32, "RopeParams");
static_assert(sizeof(AttentionParams) == 24, "AttentionParams");
static_assert(sizeof(KvStoreParams) == 12, "KvStoreParams");
static_assert(sizeof(ConvParams) == 12, "ConvParams");
static_assert(sizeof(DeltaNetParams) == 20, "DeltaNetParams");
static_assert(sizeof(RouteParams) == 16, "RouteParams");
static_assert(sizeof(MoeParams) == 8, "MoeParams");
static_assert(sizeof(RowsParams) == 8, "RowsParams");
static_assert(sizeof(MatrixDesc) == 32, "MatrixDesc");
static_assert(sizeof(AttentionSplit) == 8, "AttentionSplit");
static_assert(sizeof(EmbedParams) == 4, "EmbedParams");
static_assert(sizeof(MoeSortDesc) == 16, "MoeSortDesc");
