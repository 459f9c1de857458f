// What the host and the kernels share: the kernel parameter structs and the limits and layout
// constants both sides rely on. The Rust host owns them (crates/lily-core/src/backend/params.rs,
// the same list in the same order, with the reasons); a Rust test reads this file and checks every
// struct (fields, order, size) and every constant against it. Valid Metal (MSL), C++ (the Metal
// simulator, tools/metal-sim) and CUDA / NVRTC, so shaders/metal and shaders/cuda include the
// same file. Plain 32-bit fields. Legend: T tokens, D hidden, H/Hkv attention heads, Hk/Hv
// DeltaNet key/value heads, Dk/Dv their head dims, E experts, K experts per token, I expert width.
#pragma once

#if defined(__METAL_VERSION__) || defined(MTL_AS_CONSTANT)
// Metal, and the simulator's C++ modes (its prelude defines `constant` and `uint`).
#define LILY_CONST constant constexpr
#else
// CUDA / NVRTC, plain C++: a compile-time constant needs no address space.
typedef unsigned int uint;
#define LILY_CONST constexpr
#endif

// ---- op parameters
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

// ---- descriptors only the GPU kernels take
// A weight matrix [experts?, rows, cols]: logical row r of expert e is stored row
// e * expert_stride + row_offset + r; `group` = quantization group size (0 for dense).
struct MatrixDesc { uint rows; uint cols; uint expert_stride; uint row_offset; uint group; uint pad0; uint pad1; uint pad2; };
// Split ("flash-decoding") layout: the causal range of each query is cut into `splits` pieces of
// `split_rows` cache rows; splits == 1 writes the final output directly.
// KV row r of a cache lives in segment r >> seg_shift (addresses in a table bound beside it), at
// row r & ((1 << seg_shift) - 1) of that segment; `segments` entries in the table.
struct KvLayout { uint seg_shift; uint segments; };
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
static_assert(sizeof(KvLayout) == 8, "KvLayout");
static_assert(sizeof(AttentionSplit) == 8, "AttentionSplit");
static_assert(sizeof(EmbedParams) == 4, "EmbedParams");
static_assert(sizeof(MoeSortDesc) == 16, "MoeSortDesc");

// ---- limits and layouts (the reasons: params.rs)
LILY_CONST uint MAX_CONV_TAPS = 16;            // delta_net_conv: taps - 1 rows of history in registers
LILY_CONST uint DELTA_NET_KEY_DIM_MAX = 256;   // delta_net: 8 state values per lane
LILY_CONST uint DELTA_NET_GATED_DIM_MAX = 128; // CUDA delta_net_gated: Dk, Dv at most (a head in one block)
LILY_CONST uint DELTA_NET_GATED_TAPS_MAX = 4;  // CUDA delta_net_gated: conv taps at most (window in registers)
LILY_CONST uint DELTA_NET_CHUNK = 32;          // tokens per chunk of the chunked prefill
LILY_CONST uint DELTA_NET_COLS = 16;           // state columns per threadgroup of delta_net_chunk
LILY_CONST uint KV_SEGMENT_ROWS = 1024;        // KV-cache rows per segment by default (a power of two)
LILY_CONST uint ATTENTION_TILE = 8;            // attention: cache rows staged per step
LILY_CONST uint ATTENTION_HEAD_DIM_MAX = 256;  // attention: K/V tiles in threadgroup memory
LILY_CONST uint ATTENTION_SPLIT_ROWS = 256;    // attention: cache rows per split of the decode split layout
LILY_CONST uint ATTENTION_MAX_SPLITS = 64;     // attention: at most this many splits (split rows grow past it)
LILY_CONST uint ATTENTION_QUERY_ROWS = 64;     // CUDA attention_prefill: query rows (tokens x heads) per block
LILY_CONST uint ROPE_HEAD_DIM_MAX = 1024;      // qk_norm_rope: the normed head in threadgroup memory
LILY_CONST uint MOE_EXPERTS_MAX = 1024;        // moe_route keys, moe_scan threads
LILY_CONST uint ROUTE_TOP_K_MAX = 64;          // moe_route picks
LILY_CONST uint ROUTE_TG_WORDS = 224;          // route_token's threadgroup scratch: 3 x 32 + 2 x ROUTE_TOP_K_MAX
LILY_CONST uint MMA_TILE = 32;                 // matmul_mma: token rows and K step of a tile
LILY_CONST uint MOE_TILE = 32;                 // expert-sorted MoE: pairs per block, K step
LILY_CONST uint ARGMAX_BLOCKS = 128;           // CUDA argmax: blocks at most (their results in the step buffer)
