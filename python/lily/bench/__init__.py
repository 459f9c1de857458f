"""``lily bench MODEL``: prefill and decode speed at batch 1, the way the reference numbers were measured.

For every prompt length (default 256, 512, ..., 131072, cut to what fits ``max_seq`` and memory): synthetic
prompt ids; a warm-up at the exact shape (same prompt length, a few decode steps); then prefill tok/s = prompt
tokens / time to first token and decode tok/s over the next 64 steps (greedy). Two rounds, the second in the
reverse order; the drift between rounds is reported (>= 3 % marks the row). Each measurement runs in a fresh
process (``--same-process`` runs a whole round in one) so that peak memory is per measurement.

Next to the speed: bytes read per decoded token (weights actually touched: every tensor except the routed
experts, of which top-k of E, plus one embedding row; DeltaNet state read + write; KV cache read at the mean
context of the decode window), the effective bandwidth that implies, and the machine's memory bandwidth
measured in the same run (multi-threaded numpy copy; an MLX GPU copy for the Metal backend).

Next to prefill: the FLOPs one prompt token costs (from config.json's dims: every weight matrix the token passes
through, top-k of the routed experts, the lm_head once per prompt; causal attention at the mean context; the
DeltaNet recurrence and its conv), the GFLOP/s that implies, and the fraction of the machine's f32 matmul peak,
measured in the same run (numpy matmul; an MLX matmul for the Metal backend).

``--compare mlx-lm`` runs MLX-LM's own generation path (``mlx_lm.generate.generate_step``) on the same
checkpoint in a separate process with the same protocol and prints the ratio per length; ``--compare llama.cpp``
runs llama.cpp's ``llama-bench`` on a random-weight GGUF of the checkpoint's shapes at the same bytes per weight
(``gguf``, ``llamacpp``).

Modules: ``accounting`` (bytes and FLOPs per token), ``machine`` (probing and yardsticks), ``protocol``
(lengths, rounds, worker processes), ``workers`` (the engines, inside the workers), ``report`` (records, table,
plot), ``cli``.
"""

from lily.bench.cli import main

__all__ = ["main"]
