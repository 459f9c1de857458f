//! Elementwise ops over T rows of `dim` f32 values (`RowsParams`), no reductions:
//! - `add`: x += y (the residual stream), x, y [T, dim];
//! - `swiglu`: out = silu(gate) * up (the shared expert), gate, up, out [T, dim];
//! - `sigmoid_gate_add`: out[t, :] += sigmoid(gate[t]) * y[t, :] (the shared expert's gate),
//!   y, out [T, dim], gate [T].

pub mod cpu;
pub mod cuda;
pub mod metal;
pub mod reference;
