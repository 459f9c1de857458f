//! The Qwen3.5/3.6 MoE text decoder, written against the [`Backend`] interface:
//!
//! ```text
//! x = embed[tokens]
//! for each layer:  x += mixer(rms_norm(x))   (Gated DeltaNet or gated attention)
//!                  x += moe(rms_norm(x))
//! logits = lm_head rms_norm(x)
//! ```

pub mod attention;
pub mod delta_net;
pub mod moe;
pub mod state;

use attention::Attention;
use delta_net::DeltaNet;
use moe::Moe;
use state::{LayerState, Scratch, State};

use crate::{
    backend::{Backend, DeltaNetSeq, KvSeq, MatmulParams, RmsNormParams},
    config::{LayerKind, ModelConfig},
    error::Result,
    weights::Loader,
};

pub enum Mixer<B: Backend> {
    DeltaNet(DeltaNet<B>),
    Attention(Attention<B>),
}

pub struct Layer<B: Backend> {
    input_layernorm: B::Buf,          // [D] (1 + w)
    post_attention_layernorm: B::Buf, // [D] (1 + w)
    mixer: Mixer<B>,
    mlp: Moe<B>,
}

pub struct Model<B: Backend> {
    embed_tokens: B::Matrix, // [V, D]
    layers: Vec<Layer<B>>,
    norm: B::Buf,       // [D] (1 + w)
    lm_head: B::Matrix, // [V, D]
    hidden: usize,
    vocab: usize,
    eps: f32,
}

/// The lists [`Model::forward_batch`] borrows its sequences' states into (each row's layers, then
/// one layer's DeltaNet or KV states), kept empty between steps so that a warm step reuses their
/// allocations (`'static` only while empty: [`recycle`] hands them out at the step's lifetimes).
pub struct BatchLists<B: Backend> {
    rows: Vec<(std::slice::IterMut<'static, LayerState<B>>, usize)>,
    delta_net: Vec<DeltaNetSeq<'static, B::Buf>>,
    kv: Vec<KvSeq<'static, B::Kv>>,
}

impl<B: Backend> Default for BatchLists<B> {
    fn default() -> Self {
        BatchLists {
            rows: Vec::new(),
            delta_net: Vec::new(),
            kv: Vec::new(),
        }
    }
}

/// `v` emptied, as a list of another element type of the same size and alignment (here: the same
/// type at other lifetimes) on the same allocation: the batched step's lists of borrowed states
/// outlive each step's borrows this way. Collecting a vector's own `into_iter` reuses its buffer
/// when the layouts match (std's in-place collection; no element is produced), so this allocates
/// nothing; `tests/cpu_alloc.rs` holds that for the whole batched step.
pub(crate) fn recycle<T, U>(mut v: Vec<T>) -> Vec<U> {
    v.clear();
    v.into_iter().map(|_| unreachable!("the list was emptied")).collect()
}

impl<B: Backend> Model<B> {
    /// Load every weight through `w`, layer by layer; `progress(done, total)` after each layer
    /// (an error from it stops the load).
    pub fn load(
        b: &B,
        w: &Loader,
        cfg: &ModelConfig,
        progress: &mut dyn FnMut(usize, usize) -> Result<()>,
    ) -> Result<Self> {
        let d = cfg.hidden_size;
        let n = cfg.num_hidden_layers;
        let mut layers = Vec::with_capacity(n);
        for (i, kind) in cfg.layer_types.iter().enumerate() {
            let mixer = match kind {
                LayerKind::DeltaNet => Mixer::DeltaNet(DeltaNet::load(b, w, i, cfg)?),
                LayerKind::Attention => Mixer::Attention(Attention::load(b, w, i, cfg)?),
            };
            layers.push(Layer {
                input_layernorm: b.upload(&w.norm(&format!("layers.{i}.input_layernorm.weight"), d)?)?,
                post_attention_layernorm: b
                    .upload(&w.norm(&format!("layers.{i}.post_attention_layernorm.weight"), d)?)?,
                mixer,
                mlp: Moe::load(b, w, i, cfg)?,
            });
            progress(i + 1, n)?;
        }
        Ok(Model {
            embed_tokens: b.upload_matrix(&w.embed()?)?,
            layers,
            norm: b.upload(&w.norm("norm.weight", d)?)?,
            lm_head: b.upload_matrix(&w.lm_head()?)?,
            hidden: d,
            vocab: cfg.vocab_size,
            eps: cfg.rms_norm_eps,
        })
    }

    /// Run `t` tokens (already in `s.ids`) at positions pos0..pos0+t; leaves the final-normed
    /// hidden states in `s.h`.
    pub fn forward(&self, b: &B, t: usize, pos0: usize, state: &mut State<B>, s: &mut Scratch<B>) {
        let norm = self.norm_params(t);
        b.embed(t, &self.embed_tokens, &s.ids, &mut s.x);
        b.rms_norm(&norm, &s.x, self.input_norm(0), &mut s.h);
        for (l, (layer, st)) in self.layers.iter().zip(state.layers.iter_mut()).enumerate() {
            match (&layer.mixer, st) {
                (Mixer::DeltaNet(m), LayerState::DeltaNet(st)) => m.forward(b, t, st, s),
                (Mixer::Attention(m), LayerState::Attention(kv)) => m.forward(b, t, pos0, kv, s),
                _ => unreachable!("state is built from the same layer kinds as the model"),
            }
            self.moe_block(b, t, l, &norm, s);
        }
    }

    /// The rest of layer `l` after its mixer (output in s.mix): x += mix, the MoE block on its
    /// norm, x += moe; leaves the next layer's input norm (the final norm after the last layer)
    /// in s.h. Each residual add is fused with the norm that reads its result.
    fn moe_block(&self, b: &B, t: usize, l: usize, norm: &RmsNormParams, s: &mut Scratch<B>) {
        let layer = &self.layers[l];
        b.add_rms_norm(norm, &mut s.x, &s.mix, &layer.post_attention_layernorm, &mut s.h);
        layer.mlp.forward(b, t, norm, self.input_norm(l + 1), s);
    }

    /// The norm weight applied to the input of layer `l`: the final norm past the last layer.
    fn input_norm(&self, l: usize) -> &B::Buf {
        self.layers.get(l).map_or(&self.norm, |layer| &layer.input_layernorm)
    }

    /// One decode step of a batch: token i (in `s.ids`) appended to sequence i, `seqs[i]` = its
    /// state and position. Every weight is read once for the batch (matmuls over its rows, the
    /// MoE grouped by expert across them); each row's attention / DeltaNet runs on its own state,
    /// all rows in one batched op (`one`: its one-row scratch). Leaves the final-normed hidden
    /// states in `s.h`. `lists` holds the step's lists of borrowed states between steps, so a
    /// warm step allocates nothing.
    pub fn forward_batch(
        &self,
        b: &B,
        seqs: &mut [(&mut State<B>, usize)],
        s: &mut Scratch<B>,
        one: &mut Scratch<B>,
        lists: &mut BatchLists<B>,
    ) -> Result<()> {
        let t = seqs.len();
        let norm = self.norm_params(t);
        // Each sequence's layers in order: layer l's states of every row, borrowed at once.
        let mut rows = recycle(std::mem::take(&mut lists.rows));
        rows.extend(seqs.iter_mut().map(|(st, pos)| (st.layers.iter_mut(), *pos)));
        let mut delta_net = recycle(std::mem::take(&mut lists.delta_net));
        let mut kv = recycle(std::mem::take(&mut lists.kv));
        b.embed(t, &self.embed_tokens, &s.ids, &mut s.x);
        b.rms_norm(&norm, &s.x, self.input_norm(0), &mut s.h);
        for (l, layer) in self.layers.iter().enumerate() {
            let states = rows.iter_mut().map(|(layers, pos)| (layers.next(), *pos));
            match &layer.mixer {
                Mixer::DeltaNet(m) => {
                    delta_net.clear();
                    delta_net.extend(states.map(|st| match st {
                        (Some(LayerState::DeltaNet(st)), _) => DeltaNetSeq {
                            conv: &mut st.conv,
                            ssm: &mut st.ssm,
                        },
                        _ => unreachable!("state is built from the same layer kinds as the model"),
                    }));
                    m.project(b, t, s);
                    m.recur_batch(b, &mut delta_net, s, one)?;
                    m.output(b, t, s);
                }
                Mixer::Attention(m) => {
                    kv.clear();
                    kv.extend(states.map(|st| match st {
                        (Some(LayerState::Attention(c)), pos) => KvSeq {
                            k: &mut c.k,
                            v: &mut c.v,
                            pos,
                        },
                        _ => unreachable!("state is built from the same layer kinds as the model"),
                    }));
                    m.project(b, t, s);
                    m.attend_batch(b, &mut kv, s, one)?;
                    m.output(b, t, s);
                }
            }
            self.moe_block(b, t, l, &norm, s);
        }
        (lists.rows, lists.delta_net, lists.kv) = (recycle(rows), recycle(delta_net), recycle(kv));
        Ok(())
    }

    /// The norms' parameters over `t` rows of the hidden size.
    fn norm_params(&self, t: usize) -> RmsNormParams {
        RmsNormParams {
            rows: t as u32,
            dim: self.hidden as u32,
            eps: self.eps,
        }
    }

    /// s.logits[..rows] = lm_head s.h[row0..row0 + rows].
    pub fn logits(&self, b: &B, row0: usize, rows: usize, s: &mut Scratch<B>) {
        b.matmul(
            &MatmulParams {
                tokens: rows as u32,
                x_row0: row0 as u32,
            },
            &self.lm_head,
            &s.h,
            &mut s.logits,
        );
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }
}
