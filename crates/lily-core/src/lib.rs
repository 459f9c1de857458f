//! Lily core: a Qwen3.6-35B-A3B (Hugging Face `qwen3_5_moe`) inference engine.
//!
//! Data flow: `tokens -> embed -> L x (norm -> mixer -> +res -> norm -> moe -> +res) -> norm -> lm_head`,
//! where the mixer is a Gated DeltaNet (GDN, "linear attention") layer or a gated full-attention
//! layer. Modules:
//! - [`config`]: `config.json` with every dimension;
//! - [`safetensors`], [`weights`], [`quant`]: mmapped checkpoints, load-time quirks, MLX affine quantization;
//! - [`model`]: the forward pass as math, generic over a [`backend::Backend`];
//! - [`backend`]: the `Backend` interface and each backend's device, buffers and command stream
//!   (CPU, Metal; CUDA plugs in beside them);
//! - [`ops`]: the ops by family, each with its reference twin, CPU kernel and Metal encoder;
//! - [`engine`]: prefill / decode over one sequence;
//! - [`sampling`], [`constraint`]: the next token from the logits, optionally under a grammar;
//! - [`memory`], [`info`]: the model's footprint checked against the device, and what
//!   `lily info` reports.

pub mod backend;
pub mod config;
pub mod constraint;
pub mod engine;
pub mod error;
pub mod info;
pub mod memory;
pub mod model;
pub mod ops;
pub mod quant;
pub mod safetensors;
pub mod sampling;
pub mod weights;

pub use engine::{BackendKind, Engine};
pub use error::{Error, Result};
