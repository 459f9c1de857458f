//! The ops, by family: one folder per family holds everything about its ops.
//!
//! ```text
//! ops/<family>/mod.rs        what the ops compute, the layouts and shapes (parameter structs:
//!                            backend/params.rs, shared with shaders/params.h)
//! ops/<family>/reference.rs  the reference twin: plain loops, f32 accumulation, obviously correct;
//!                            every kernel is tested against it (Cpu::reference() runs it)
//! ops/<family>/cpu.rs        the production CPU kernels (SIMD, thread pool, in-kernel dequant)
//! ops/<family>/metal.rs      the Metal encoders: which kernel, bindings, grid, scratch
//! ops/<family>/cuda.rs       the CUDA encoders: which kernel, arguments, grid, scratch
//! shaders/metal/<family>.metal  the Metal kernels; shaders/cuda/*.cu the CUDA kernels
//! tests/ops_<family>.rs      reference, CPU and the GPU backends (simulators, devices) against each other
//! ```
//!
//! The `Backend` impls (`backend/cpu/mod.rs`, `backend/metal/mod.rs`, `backend/cuda/mod.rs`) are
//! one line per op into these files; the plumbing they share (CPU pool, ISA choice, SIMD
//! primitives; Metal and CUDA command streams, buffers, kernel tables, executors) stays in
//! `backend/`. Families: [`embed`],
//! [`norm`] (rms_norm, rms_norm_gated, add_rms_norm, add_gated_rms_norm,
//! moe_experts_add_rms_norm), [`matmul`],
//! [`attention`] (qk_norm_rope, kv_store, qk_norm_rope_store, attention), [`delta_net`]
//! (delta_net_conv, delta_net), [`moe`] (moe_route, moe_experts, gate_up_swiglu), [`elementwise`]
//! (add, swiglu, sigmoid_gate_add).
//!
//! Fused ops (add_rms_norm, add_gated_rms_norm, moe_experts_add_rms_norm, qk_norm_rope_store,
//! gate_up_swiglu) are one dispatch on a GPU (moe_experts_add_rms_norm: one after the expert
//! GEMVs) for what is several ops in the math; the `Backend` trait defines each as its unfused ops
//! (the default method), so the reference twin of a fused kernel is the reference twins of its
//! parts, and a backend without the fused kernel runs the parts.

pub mod attention;
pub mod delta_net;
pub mod elementwise;
pub mod embed;
pub mod matmul;
pub mod moe;
pub mod norm;

/// The buffer-size check of every GPU encoder: `checks` holds (buffer name, elements it has,
/// elements the op needs); the first one too small is an error naming the op and the buffer.
pub fn check_sizes(op: &str, checks: &[(&str, usize, usize)]) -> Result<(), String> {
    match checks.iter().find(|&&(_, have, need)| have < need) {
        Some((what, have, need)) => Err(format!("{op}: {what} has {have} elements, needs {need}")),
        None => Ok(()),
    }
}

/// [`check_sizes`] of (buffer name, buffer, elements the op needs) entries, `len` giving a
/// buffer's elements: the check of encoders that list their buffers once for checking and binding.
pub fn check_bufs<Buf>(op: &str, bufs: &[(&str, &Buf, usize)], len: impl Fn(&Buf) -> usize) -> Result<(), String> {
    match bufs.iter().find(|&&(_, b, need)| len(b) < need) {
        Some(&(what, b, need)) => Err(format!("{op}: {what} has {} elements, needs {need}", len(b))),
        None => Ok(()),
    }
}

/// x sigmoid(x).
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// log(1 + e^x), linear above 20 like torch.
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}
