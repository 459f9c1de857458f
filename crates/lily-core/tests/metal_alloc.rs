//! The Metal host layer encodes a warm forward pass without allocating: the tiny checkpoint's
//! model (`metal_common::TinyCheckpoint`) runs decode steps and prefill chunks through
//! `Metal<NullExec>`, an executor that checks and counts every dispatch and runs nothing, and a
//! counting global allocator (of this thread's allocations only: the test harness allocates on
//! its own threads) sees none. What is counted is everything the shared encoding layer
//! (`backend/metal/{mod,kernels,args}.rs`) and the model do per step: kernel and pipeline
//! lookups, parameter bytes, bindings, scratch reuse, command-stream labels, the executor calls.
//! The executors' own work inside `dispatch` / `commit_wait` is theirs (the device's is
//! allocation-free on the Rust side; the simulator records dispatches, test tooling).

use std::{
    alloc::{GlobalAlloc, Layout, System},
    ptr::NonNull,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
};

mod alloc_common;
mod common;
mod gpu_common;
mod metal_common;

use alloc_common::{allocations_in, decode_step};
use lily_core::{
    backend::{
        metal::{Arg, Executor, GpuFamily, Grid, Metal, ParamBytes, StreamLabel, Variants},
        Backend, KvDtype, StreamKind,
    },
    config::LayerKind,
    error::Result,
    model::state::{Scratch, State},
};
use metal_common::{state_and_scratch, TinyCheckpoint};

// ---- An executor that checks and counts dispatches, and runs nothing ---------------------------

/// Zeroed host memory standing in for a buffer (`contents` works: the backend reads and writes it).
struct Mem {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: a plain heap allocation; nothing runs kernels on it.
unsafe impl Send for Mem {}
unsafe impl Sync for Mem {}

impl Drop for Mem {
    fn drop(&mut self) {
        // SAFETY: allocated in `new_buffer` with this layout.
        unsafe { System.dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

struct NullPipeline {
    name: String,
}

struct NullEncoder {
    label: StreamLabel,
    dispatches: usize,
}

/// Checks each dispatch as the device would (the pipeline is the named kernel's, bindings inside
/// their buffers, parameter bytes whole words of at most 32 bytes, at most 1024 threads and
/// 32 KiB of threadgroup memory per threadgroup) and counts it; runs nothing.
#[derive(Default)]
struct NullExec {
    /// The first failed check (formatted only on failure).
    error: Mutex<Option<String>>,
    /// The label and dispatch count of the last command stream committed.
    last: Mutex<Option<(StreamLabel, usize)>>,
    streams: AtomicUsize,
}

impl NullExec {
    fn fail(&self, why: impl FnOnce() -> String) {
        let mut e = self.error.lock().unwrap();
        if e.is_none() {
            *e = Some(why());
        }
    }
}

impl Executor for NullExec {
    const NAME: &'static str = "metal-null";
    type Buffer = Arc<Mem>;
    type Pipeline = NullPipeline;
    type Encoder = NullEncoder;
    type Pending = ();

    fn describe(&self) -> String {
        "null executor (tests)".into()
    }
    fn family(&self) -> GpuFamily {
        GpuFamily::NEWEST
    }
    fn new_buffer(&self, bytes: usize) -> Result<Arc<Mem>> {
        let layout = Layout::from_size_align(bytes.max(16), 64).unwrap();
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { System.alloc_zeroed(layout) }).expect("out of memory");
        Ok(Arc::new(Mem { ptr, layout }))
    }
    fn contents(&self, b: &Arc<Mem>) -> *mut u8 {
        b.ptr.as_ptr()
    }
    fn gpu_address(&self, b: &Arc<Mem>) -> u64 {
        b.ptr.as_ptr() as u64
    }
    fn pipeline(&self, name: &str) -> Result<NullPipeline> {
        Ok(NullPipeline { name: name.to_string() })
    }
    fn encoder(&self, label: StreamLabel) -> Result<NullEncoder> {
        Ok(NullEncoder { label, dispatches: 0 })
    }
    fn dispatch(
        &self,
        enc: &mut NullEncoder,
        name: &str,
        p: &NullPipeline,
        args: &[Arg<'_, Arc<Mem>>],
        grid: Grid,
        tg_mem: &[usize],
    ) {
        enc.dispatches += 1;
        if p.name != name {
            self.fail(|| format!("{name}: dispatched with the pipeline of {}", p.name));
        }
        for (i, a) in args.iter().enumerate() {
            match a {
                Arg::Bytes(b) => {
                    let n = b.as_slice().len();
                    if n == 0 || n % 4 != 0 || n > ParamBytes::MAX {
                        self.fail(|| format!("{name}: binding {i}: {n} parameter bytes"));
                    }
                }
                Arg::Buf(b, off, len) => {
                    if off + len > b.layout.size() {
                        let size = b.layout.size();
                        self.fail(|| format!("{name}: binding {i}: {len} bytes at {off} of a {size}-byte buffer"));
                    }
                }
            }
        }
        let (Grid::Groups { size, .. } | Grid::Threads { size, .. }) = grid;
        let threads: u32 = size.iter().product();
        if threads == 0 || threads > 1024 {
            self.fail(|| format!("{name}: {threads} threads per threadgroup"));
        }
        let tg: usize = tg_mem.iter().map(|b| b.div_ceil(16) * 16).sum();
        if tg > 32 * 1024 {
            self.fail(|| format!("{name}: {tg} bytes of threadgroup memory"));
        }
    }
    fn commit(&self, enc: NullEncoder) -> Result<()> {
        *self.last.lock().unwrap() = Some((enc.label, enc.dispatches));
        self.streams.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
    fn wait(&self, _: ()) -> Result<()> {
        Ok(())
    }
}

// ---- The tests ---------------------------------------------------------------------------------

#[test]
fn the_counter_counts() {
    let (n, v) = allocations_in(|| Vec::<u64>::with_capacity(3));
    assert_eq!(n, 1);
    drop(v);
    let (n, _) = allocations_in(|| format!("{}", 12345).len());
    assert!(n >= 1);
    let (n, _) = allocations_in(|| [1u8; 4].iter().sum::<u8>());
    assert_eq!(n, 0);
}

/// Prefill chunks (the simdgroup-matrix GEMMs, the expert-sorted MoE, the chunked DeltaNet) and
/// decode steps (the GEMVs, the per-token MoE, the DeltaNet step, attention over the cache,
/// split and not) of the tiny checkpoint, with the kernel variants of the oldest and the newest
/// GPU family: once warm (pipelines of the variants built, scratch grown), encoding them and
/// reading the logits back allocates nothing, and every decode step encodes the same dispatches
/// into one stream labelled "lily step N".
#[test]
fn warm_forward_passes_do_not_allocate() {
    let ckpt = TinyCheckpoint::write();
    let mut m = Metal::new(NullExec::default()).unwrap();
    let (cfg, model) = ckpt.model(&m);
    let (prompt, decode) = TinyCheckpoint::tokens();
    let tok = decode[0];
    let vocab = cfg.vocab_size;
    let mut logits = vec![0f32; 16 * vocab];
    for (family, split_rows) in [(GpuFamily::Apple7, 256), (GpuFamily::Apple10, 16)] {
        m.variants = Variants::for_family(family);
        // Decode attention at 40+ cache rows: one pass under 256 rows, split past 16.
        m.split_rows = split_rows;
        let what = format!("{family} variants, split past {split_rows} rows");
        let (mut state, mut s) = state_and_scratch(&m, &cfg, KvDtype::BF16);
        let b = &m;
        let mut prefill = |s: &mut Scratch<Metal<NullExec>>, state: &mut State<Metal<NullExec>>| {
            alloc_common::prefill(b, &model, &prompt, s, state, &mut logits)
        };
        prefill(&mut s, &mut state);
        let (n, ()) = allocations_in(|| prefill(&mut s, &mut state));
        assert_eq!(
            n,
            0,
            "{what}: {n} allocations encoding a warm {}-token prefill chunk",
            prompt.len()
        );
        let step = |i: usize, s: &mut Scratch<Metal<NullExec>>, state: &mut State<Metal<NullExec>>| {
            decode_step(b, &model, (tok, prompt.len() + i), vocab, s, state);
            b.executor()
                .last
                .lock()
                .unwrap()
                .take()
                .expect("a command stream per step")
        };
        let (_, warm_dispatches) = step(0, &mut s, &mut state);
        assert!(warm_dispatches > 20, "{what}: {warm_dispatches} dispatches per step");
        for i in 1..=8 {
            let (n, (label, dispatches)) = allocations_in(|| step(i, &mut s, &mut state));
            assert_eq!(n, 0, "{what}: {n} allocations encoding warm decode step {i}");
            assert!(matches!(label, StreamLabel::Step(_)), "{what}: {label:?}");
            assert_eq!(dispatches, warm_dispatches, "{what}: step {i}");
        }
        if let Some(e) = m.executor().error.lock().unwrap().take() {
            panic!("{what}: {e}");
        }
    }
    assert!(m.executor().streams.load(Ordering::Relaxed) > 20);
}

/// Dispatches per decode step for the real model's layer structure (40 layers: 30 DeltaNet and
/// 10 full attention, every 4th; the count depends on the layers and the context, not on the
/// dimensions, so the tiny ones stand in): at context 256 (attention in one pass) and 32K (split,
/// then reduced). Issue 12's target is fewer than the reference engine's 795 per step
/// (spec/techniques.md), at every context; today's count is 443 at context 256 (523 before the
/// MoE's shared expert ran as T more pairs of the routed experts' GEMVs, 583 before a DeltaNet
/// layer's conv, recurrence and gated norm became one `delta_net_gated`, 923 before the
/// residual adds, the MoE's shared-expert gate and the cache appends were fused, 783 before the
/// shared expert's gate, up and SwiGLU became one `gate_up_swiglu`, 703 before the MoE's combine
/// was folded into the residual norm, `moe_experts_add_rms_norm`, 663 before the router GEMV, the
/// shared gate's and `moe_route` became one `moe_router`; printed with
/// `-- --nocapture`), so this gate holds it there: lower `DECODE_DISPATCHES` as kernels fuse,
/// and raising it needs a reason.
#[test]
fn decode_step_dispatches_for_the_real_layer_structure() {
    const DECODE_DISPATCHES: usize = 443;
    const REFERENCE_ENGINE: usize = 795;
    let ckpt = TinyCheckpoint::with_layers(40, 4);
    let m = Metal::new(NullExec::default()).unwrap();
    let (cfg, model) = ckpt.model(&m);
    assert_eq!(
        cfg.layer_types.iter().filter(|k| **k == LayerKind::Attention).count(),
        10
    );
    let mut s = Scratch::new(&m, &cfg, 16, 16).unwrap();
    let mut counts = Vec::new();
    for context in [256usize, 32 * 1024] {
        let mut state = State::new(&m, &cfg, context, KvDtype::BF16).unwrap();
        state.reserve(&m, context).unwrap();
        m.begin(StreamKind::Decode).unwrap();
        m.write_ids(&mut s.ids, &[1]).unwrap();
        model.forward(&m, 1, context - 1, &mut state, &mut s);
        model.logits(&m, 0, 1, &mut s);
        m.finish().unwrap();
        if let Some(e) = m.executor().error.lock().unwrap().take() {
            panic!("context {context}: {e}");
        }
        let (label, dispatches) = m.executor().last.lock().unwrap().take().unwrap();
        assert!(matches!(label, StreamLabel::Step(_)), "{label:?}");
        eprintln!("decode step at context {context}: {dispatches} dispatches (40 layers: 30 DeltaNet, 10 attention)");
        counts.push(dispatches);
    }
    assert!(
        counts[0] <= DECODE_DISPATCHES,
        "{} dispatches per decode step at context 256, more than the {DECODE_DISPATCHES} of before (the target: under the reference engine's 795)",
        counts[0]
    );
    // The split attention adds its reduce pass in each attention layer, nothing else.
    assert_eq!(counts[1], counts[0] + 10, "{counts:?}");
    assert!(
        counts.iter().all(|&c| c < REFERENCE_ENGINE),
        "{counts:?}: not under the reference engine's {REFERENCE_ENGINE}"
    );
}
