//! The CUDA host layer encodes warm forward passes without allocating, and repeated decode steps
//! replay one captured graph: the tiny checkpoint (`metal_common::TinyCheckpoint`) runs prefill
//! chunks and decode steps through `Cuda<Null>` (an executor that records and counts launches
//! and runs nothing), under a counting global allocator (this thread's allocations only).
//! Counted: everything the encoding layer (`backend/cuda/{mod,args,kernels}.rs`) and the model do
//! per call: kernel lookups, argument packing, the command list, graph reuse, executor calls.

mod alloc_common;
mod common;
mod gpu_common;
mod metal_common;

use alloc_common::{allocations_in, decode_step};
use lily_core::{
    backend::{
        cuda::{Cuda, Null},
        Backend, KvDtype, StreamKind,
    },
    config::LayerKind,
    model::state::{Scratch, State},
};
use metal_common::{state_and_scratch, TinyCheckpoint};

#[test]
fn warm_forward_passes_do_not_allocate_and_decode_replays_one_graph() {
    let ckpt = TinyCheckpoint::write();
    let c = Cuda::new(Null::new(false)).unwrap();
    let (cfg, model) = ckpt.model(&c);
    let (prompt, decode) = TinyCheckpoint::tokens();
    let vocab = cfg.vocab_size;
    let mut logits = vec![0f32; 16 * vocab];
    let (mut state, mut s) = state_and_scratch(&c, &cfg, KvDtype::BF16);
    let b = &c;
    let mut prefill = |s: &mut Scratch<Cuda<Null>>, state: &mut State<Cuda<Null>>| {
        alloc_common::prefill(b, &model, &prompt, s, state, &mut logits)
    };
    // The first chunk runs its launches one by one, the second (the same commands) is captured into
    // a graph (allocating the graph once); from then on a chunk of that length replays it.
    prefill(&mut s, &mut state);
    prefill(&mut s, &mut state);
    let (n, ()) = allocations_in(|| prefill(&mut s, &mut state));
    assert_eq!(
        n,
        0,
        "{n} allocations encoding a warm {}-token prefill chunk",
        prompt.len()
    );

    let step = |i: usize, s: &mut Scratch<Cuda<Null>>, state: &mut State<Cuda<Null>>| {
        decode_step(b, &model, (decode[0], prompt.len() + i), vocab, s, state)
    };
    let before = c.executor().counts();
    step(0, &mut s, &mut state); // launched one by one
    step(1, &mut s, &mut state); // the same commands again: captured into a graph, replayed
    let (launches, graphs, replays) = c.executor().counts();
    let per_step = launches - before.0;
    assert!(per_step >= 38, "{per_step} launches in two steps");
    assert_eq!(
        (graphs - before.1, replays - before.2),
        (1, 1),
        "one capture, one replay"
    );
    // The prefill chunks' graph was captured plain, the decode step's with programmatic launch.
    assert_eq!(
        (c.executor().programmatic_captures(), graphs),
        (1, 2),
        "programmatic captures of all captures"
    );
    for i in 2..=9 {
        let (n, ()) = allocations_in(|| step(i, &mut s, &mut state));
        assert_eq!(n, 0, "{n} allocations encoding warm decode step {i}");
    }
    let (l2, g2, r2) = c.executor().counts();
    assert_eq!(
        (l2, g2, r2 - replays),
        (launches, graphs, 8),
        "every later step replays the graph"
    );
}

/// The launches of a decode step, as the executor sees them: the kernels of the model's layers in
/// order, each with a valid shape (the null executor checks grids and blocks).
#[test]
fn a_decode_step_launches_the_expected_kernels() {
    let ckpt = TinyCheckpoint::write();
    let mut c = Cuda::new(Null::new(true)).unwrap();
    c.graphs = false;
    let (cfg, model) = ckpt.model(&c);
    let (mut state, mut s) = state_and_scratch(&c, &cfg, KvDtype::BF16);
    c.executor().take_log();
    c.begin(StreamKind::Decode).unwrap();
    c.write_ids(&mut s.ids, &[5]).unwrap();
    model.forward(&c, 1, 7, &mut state, &mut s);
    model.logits(&c, 0, 1, &mut s);
    c.finish().unwrap();
    let names: Vec<String> = c.executor().take_log().into_iter().map(|r| r.name).collect();
    assert!(names[0].starts_with("embed_"), "{names:?}");
    assert!(names.last().unwrap().starts_with("matmul_gemv_"), "{names:?}");
    for k in [
        "add_rms_norm",
        "moe_experts_add_rms_norm",
        "attention",
        "delta_net_gated",
    ] {
        assert!(names.iter().any(|n| n == k), "{k} not launched: {names:?}");
    }
    // The fused kernels replace the unfused ones they stand for (one launch instead of two or three;
    // decode attention combines its splits and does qk_norm_rope_store's work itself).
    for k in [
        "qk_norm_rope",
        "kv_store",
        "add",
        "sigmoid_gate_add",
        "swiglu",
        "moe_combine",
        "add_gated_rms_norm",
        "moe_route",
        "delta_net_conv",
        "delta_net",
        "rms_norm_gated",
        "attention_reduce",
        "qk_norm_rope_store",
    ] {
        assert!(
            !names.iter().any(|n| n == k),
            "{k} launched beside its fused form: {names:?}"
        );
    }
    // One MoE block end per layer (the tiny model's 2): combine, residual and norm in one launch.
    let ends = names.iter().filter(|n| *n == "moe_experts_add_rms_norm").count();
    assert_eq!(ends, 2, "{names:?}");
    // One routing launch per layer: the router and shared-gate GEMV, softmax, top K and renorm.
    let routers = names.iter().filter(|n| n.starts_with("moe_router_")).count();
    assert_eq!(routers, 2, "{names:?}");
    // One DeltaNet launch per DeltaNet layer: the conv, the recurrence and the gated norm.
    let delta_layers = cfg.layer_types.iter().filter(|k| **k == LayerKind::DeltaNet).count();
    let delta_nets = names.iter().filter(|n| *n == "delta_net_gated").count();
    assert_eq!((delta_layers, delta_nets), (1, 1), "{names:?}");
    // The shared expert runs as each token's last pair of the routed experts' GEMVs (it has their
    // format and shapes): one moe_gate_up and one moe_down per layer, no gate_up_swiglu and no
    // down GEMV of its own.
    for k in ["moe_gate_up_", "moe_down_"] {
        let n = names.iter().filter(|n| n.starts_with(k)).count();
        assert_eq!(n, 2, "{k}: {names:?}");
    }
    assert!(
        !names.iter().any(|n| n.starts_with("gate_up_swiglu_")),
        "the shared expert launched apart: {names:?}"
    );
    // A layer's MoE block is 4 launches: routing, the experts' two GEMVs, combine + residual + norm.
    for (i, _) in names.iter().enumerate().filter(|(_, n)| n.starts_with("moe_router_")) {
        let block: Vec<&str> = names[i + 1..i + 4].iter().map(|n| n.as_str()).collect();
        assert!(
            block[0].starts_with("moe_gate_up_")
                && block[1].starts_with("moe_down_")
                && block[2] == "moe_experts_add_rms_norm",
            "the MoE block after its router: {block:?}"
        );
    }
    // 27 before delta_net_gated (conv, recurrence and gated norm were three launches) and the
    // shared expert as a pair of the routed experts' GEMVs (two launches fewer per layer); 21
    // before decode attention combined its splits and did qk_norm_rope_store's work in the same
    // launch (no attention_reduce, no qk_norm_rope_store: two fewer per attention layer).
    assert_eq!(names.len(), 19, "{names:?}");
    eprintln!("{} launches in a decode step: {names:?}", names.len());
}
