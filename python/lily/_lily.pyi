"""Native core of Lily (Rust): the model, its per-sequence state and the backends."""

import os
from collections.abc import Callable, Sequence
from typing import Any, Literal, final

import numpy as np
import numpy.typing as npt
from typing_extensions import Self

__all__ = [
    "Constraint",
    "ContextFullError",
    "DeviceError",
    "Engine",
    "LilyError",
    "ModelLoadError",
    "Sampler",
    "SequenceEvictedError",
    "Snapshot",
    "Vocab",
    "checkpoint_fit",
    "system_info",
]

class LilyError(Exception):
    """Base class of every Lily error."""

class ModelLoadError(LilyError):
    """The checkpoint or its config.json could not be loaded (missing file, bad field, bad tensor)."""

class ContextFullError(LilyError):
    """The sequence would grow past the engine's ``max_seq``; the engine is left unchanged."""

class DeviceError(LilyError):
    """The backend device is unavailable or a command failed on it."""

class SequenceEvictedError(LilyError):
    """A generation's sequence was taken over by a later generation on the same model.

    A ``Model`` holds one sequence: starting a generation (``generate``, ``stream``, ``chat``) gives it the
    sequence, and a stream started earlier raises this error when it is resumed. The finished part of its
    output is valid; it cannot continue.
    """

@final
class Engine:
    """One Qwen3.6 MoE model and its sequences on one backend.

    ``path`` is a checkpoint folder (MLX affine-quantized or Hugging Face bf16 safetensors with
    ``config.json``). ``backend`` is ``"auto"`` (the best available), ``"cpu"``, ``"cpu-reference"``
    (plain-loop kernels, for checking), ``"metal"``, ``"metal-sim"``, ``"cuda"`` or ``"cuda-sim"`` (the CUDA
    kernels run on the CPU by a simulator, for checking). ``max_seq`` caps the
    sequence length (default: the config's ``max_position_embeddings``, 262,144 for Qwen3.6); the KV
    cache grows in segments as the sequence does, so a large ``max_seq`` costs no memory until used.
    ``kv_dtype`` is the element type of the stored keys and values: ``"bf16"`` (default), ``"f16"``
    or ``"f32"`` (twice the memory; exact fp32 attention, for checking). ``prefill_chunk`` is the
    number of tokens per forward call during prefill (default: the backend's, 1024 on the CPU): larger
    is faster and takes more scratch memory (about 270 KB per token at the real shapes).
    ``precision`` is how the CPU backend's 4-bit matmuls round the activations: ``"exact"`` (default;
    fp32-exact) or ``"fast"`` (one int8 plane per weight group, as llama.cpp's q8 activations:
    a little below bf16 accuracy, faster prefill and decode); the GPU backends ignore it.
    ``progress(done, total)`` is called as layers load; an exception it raises stops the load and
    propagates, as does Ctrl-C (checked between layers).

    The GIL is released while the model loads and runs. An engine may be shared by threads: calls take
    turns (a call waits, GIL released, for the one running) and each is atomic; a call from Python code run
    inside a call on the same engine (a signal handler) raises ``RuntimeError``.

    Sequences: the weights, backend and scratch are shared by any number of sequences, each with its own
    KV rows, DeltaNet states, position and tokens. Sequence ``0`` (the default of every ``seq=`` argument)
    always exists; ``new_sequence`` / ``fork`` make more, ``drop_sequence`` frees one. ``decode_batch``
    advances several sequences by one token each in one pass over the weights.
    """

    def __new__(
        cls,
        path: str | os.PathLike[str],
        *,
        backend: Literal["auto", "cpu", "cpu-reference", "metal", "metal-sim", "cuda", "cuda-sim"] | str = "auto",
        max_seq: int | None = None,
        prefill_chunk: int | None = None,
        progress: Callable[[int, int], object] | None = None,
        kv_dtype: Literal["bf16", "f16", "f32"] | str = "bf16",
        precision: Literal["exact", "fast"] | str = "exact",
    ) -> Self: ...
    def prefill(
        self, tokens: Sequence[int], *, all_logits: bool = False, seq: int = 0
    ) -> npt.NDArray[np.float32]:
        """Append ``tokens`` to the sequence (a second call continues it).

        Returns the next-token logits after the last token, shape ``[vocab_size]``, or with
        ``all_logits=True`` after every token, shape ``[len(tokens), vocab_size]``. Raises
        ``ValueError`` for an empty list or a token id outside ``[0, vocab_size)`` and
        ``ContextFullError`` past ``max_seq``; either way the sequence is unchanged.

        Ctrl-C (or any exception raised by a signal handler) stops a prefill of several chunks
        (``prefill_chunk`` tokens each) between two chunks: the exception propagates and the sequence keeps
        the chunks completed so far (``position`` says how far it got), a consistent state to continue from.
        """
    def decode(self, token: int, *, seq: int = 0) -> npt.NDArray[np.float32]:
        """Append one token; its next-token logits, shape ``[vocab_size]``."""
    def decode_greedy(self, token: int, *, seq: int = 0) -> int:
        """Append one token; the id of its largest next-token logit (the lowest id among equal ones), computed
        where the logits are: on a GPU only the id is copied back. The logits of padding ids are included."""
    def decode_batch(self, batch: Sequence[tuple[int, int]]) -> npt.NDArray[np.float32]:
        """Append one token to each of several sequences: ``batch`` is ``[(seq, token), ...]``, each
        sequence at most once (at most ``prefill_chunk`` of them). One pass over the weights serves them
        all; each sequence's attention and DeltaNet run at its own position. Returns the next-token
        logits, shape ``[len(batch), vocab_size]``, in the order given. On error no sequence changes.
        """
    def decode_batch_greedy(self, batch: Sequence[tuple[int, int]]) -> list[int]:
        """``decode_batch`` for greedy decoding: the id of each sequence's largest next-token logit (the
        lowest id among equal ones), in the order given, computed where the logits are (no
        ``[len(batch), vocab_size]`` block is copied out). Same checks; on error no sequence changes."""
    def new_sequence(self) -> int:
        """A new, empty sequence; its id (ids are never reused)."""
    def fork(self, seq: int = 0) -> int:
        """A new sequence holding a copy of ``seq`` (KV rows, DeltaNet states, position, tokens)."""
    def copy_sequence(self, src: int, dst: int) -> None:
        """Sequence ``dst`` becomes a copy of ``src``; what it held before is gone."""
    def export_sequence(
        self, seq: int = 0, *, first_row: int = 0
    ) -> tuple[list[int], str, dict[str, npt.NDArray[Any]]]:
        """Sequence ``seq``'s state: ``(tokens, kv_dtype, tensors)``, the tensors ``layers.{i}.k`` / ``.v``
        (rows ``first_row`` to the position, [position - first_row, Hkv * hd]: uint16 bit patterns of a bf16 /
        f16 cache, float32 of an f32 one) and ``layers.{i}.conv`` / ``.ssm`` (float32 DeltaNet states). Only a
        whole state (``first_row`` 0) can be imported; ``first_row`` past the position is a ``ValueError``."""
    def import_sequence(
        self, tokens: Sequence[int], kv_dtype: str, tensors: dict[str, npt.NDArray[Any]], *, seq: int = 0
    ) -> None:
        """Sequence ``seq`` becomes a state from ``export_sequence`` (of an engine of the same model and
        kv_dtype); a state that does not fit raises ``ValueError`` / ``TypeError`` and changes nothing."""
    def drop_sequence(self, seq: int) -> None:
        """Free sequence ``seq`` (``ValueError`` for sequence 0, which always exists: reset it)."""
    @property
    def sequences(self) -> list[int]:
        """The live sequences' ids."""
    def sequence_position(self, seq: int) -> int:
        """Tokens in sequence ``seq``."""
    def sequence_tokens(self, seq: int) -> list[int]:
        """The token ids of sequence ``seq``."""
    def sequence_bytes(self, seq: int) -> int:
        """Bytes sequence ``seq`` holds: its KV segments (those shared with forks included) and DeltaNet
        states."""
    def sequences_bytes(self, seqs: list[int]) -> int:
        """Bytes the sequences hold together, a KV segment they share counted once."""
    def sequence_unique_bytes(self, seq: int) -> int:
        """Bytes only sequence ``seq`` holds (what dropping it frees): shared KV segments excluded."""
    def reset(self, *, seq: int = 0) -> None:
        """Start a new, empty sequence."""
    def fill_context(self, n: int, *, seed: int = 0) -> None:
        """Append ``n`` positions of synthetic context (random K/V rows, the DeltaNet state as it is), so that
        decode runs at that depth without the prefill's cost. For benchmarks: these positions match no token."""
    def snapshot(self, *, seq: int = 0) -> Snapshot:
        """Copy the sequence state at the current position (DeltaNet states; KV rows are shared)."""
    def restore(self, snapshot: Snapshot, *, seq: int = 0) -> None:
        """Return to ``snapshot`` (earlier or later than now) if its tokens are still in the KV cache.

        Raises ``ValueError`` if the snapshot is from another engine or its tokens were overwritten.
        """
    def cached_prefix(self, tokens: Sequence[int], *, seq: int = 0) -> int:
        """How many leading ``tokens`` equal the tokens whose KV rows are in the cache."""
    @property
    def position(self) -> int:
        """Tokens in the default sequence."""
    @property
    def kv_dtype(self) -> str:
        """Element type of the stored K/V rows: ``"bf16"``, ``"f16"`` or ``"f32"``."""
    @property
    def precision(self) -> str:
        """How the CPU's 4-bit matmuls round the activations: ``"exact"`` or ``"fast"``."""
    @property
    def kv_bytes(self) -> int:
        """Bytes of KV cache held now (it grows in segments with the sequence; reset keeps one)."""
    @property
    def max_seq(self) -> int:
        """Longest sequence this engine holds."""
    @property
    def prefill_chunk(self) -> int:
        """Tokens per forward call during prefill."""
    @property
    def vocab_size(self) -> int:
        """Rows of the logits (the checkpoint's vocab_size, padding ids included)."""
    @property
    def backend(self) -> str:
        """The backend running the model, e.g. ``"cpu"``."""
    @property
    def copied_weight_bytes(self) -> int:
        """Bytes of weights the backend copied because it could not read them in place from the mapped checkpoint
        (Metal: a tensor not 4-byte aligned in its file; each such load is also in ``notes``); 0 on the CPU."""
    @property
    def notes(self) -> list[str]:
        """What the engine chose at load, in words: the backend ``"auto"`` picked and why, a ``max_seq``
        fitted to the device's memory."""
    @property
    def device(self) -> str:
        """The device the engine runs on, in words (e.g. the GPU's name and architecture)."""
    @property
    def device_peak_bytes(self) -> int | None:
        """Peak device memory the engine has allocated (weights, state, scratch) on CUDA; None elsewhere."""
    def measure_device_bandwidth(self, mib: int = 1024) -> float | None:
        """GPU memory bandwidth in GB/s (a device-to-device copy of ``mib`` MiB, (read + write) / time, best of 5);
        None on the CPU backends."""
    @property
    def config(self) -> dict[str, Any]:
        """The checkpoint's ``config.json`` as a dict."""

@final
class Snapshot:
    """The state of an engine's sequence at one position, from ``Engine.snapshot()``."""

    @property
    def position(self) -> int:
        """Tokens in the sequence when the snapshot was taken."""
    @property
    def tokens(self) -> list[int]:
        """The sequence's token ids when the snapshot was taken."""

@final
class Sampler:
    """Token sampling over a logits row, in Rust (the policy lives in ``lily.sampling``).

    Padding ids at or beyond ``vocab_limit`` are never sampled. The same seed gives the same tokens.
    """

    def __new__(
        cls,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: dict[int, float] | None = None,
        vocab_limit: int | None = None,
        seed: int = 0,
    ) -> Self: ...
    def sample(
        self, logits: npt.NDArray[np.float32], logprob: bool = False, constraint: Constraint | None = None
    ) -> tuple[int, float | None]:
        """Draw one token id; with ``logprob`` also its log-probability under the raw logits. With a
        ``constraint``, only ids its grammar allows are drawn and the token is committed to it."""
    def top_logprobs(self, logits: npt.NDArray[np.float32], k: int) -> list[tuple[int, float]]:
        """The ``k`` most likely ids under the raw logits with their log-probabilities, most likely first."""
    def reset(self, prompt: Sequence[int], seed: int) -> None:
        """Start a new sequence: penalties count ``prompt``; the random stream restarts from ``seed``."""
    def accept(self, token: int) -> None:
        """Record a generated token (for the penalties)."""

@final
class Vocab:
    """The token bytes of one tokenizer, for compiling grammars (structured output).

    ``tokens[i]`` is the UTF-8 text of id ``i``; ``special`` ids are control tokens no grammar text
    matches; ``eos`` ids end a generation (allowed once the grammar is complete); ``rows`` is the
    length of the logits row (ids past ``len(tokens)`` are padding, never allowed).
    """

    def __new__(cls, tokens: Sequence[bytes], *, special: Sequence[int], eos: Sequence[int], rows: int) -> Self: ...
    def constrain(self, kind: Literal["json_schema", "lark", "regex", "llguidance"] | str, source: str) -> Constraint:
        """Compile a grammar into a fresh constraint for one generation (``ValueError`` if it does not compile)."""
    @property
    def rows(self) -> int:
        """Entries of the logits row a mask covers."""

@final
class Constraint:
    """A grammar followed by one generation; pass it to ``Sampler.sample`` at every step. The mask for
    the next token is computed on a thread of its own after each committed token."""

    def allows(self, token: int) -> bool:
        """Whether the grammar allows ``token`` next."""
def system_info() -> dict[str, Any]:
    """This machine as Lily sees it, building no backend: ``version``, ``os``, ``auto`` (``backend``,
    ``reason``, ``fallback``: the CPU chosen although a GPU backend exists for this platform) and ``metal``
    (``device``, ``gpu_family``, ``recommended_max_working_set_size``, ``unified_memory``,
    ``max_buffer_length``; or ``error``: why there is no Metal GPU)."""

def checkpoint_fit(
    path: str | os.PathLike[str],
    *,
    backend: str = "auto",
    max_seq: int | None = None,
    prefill_chunk: int | None = None,
    kv_dtype: str = "bf16",
) -> dict[str, Any]:
    """Whether the checkpoint in ``path`` fits ``backend``'s memory at ``max_seq``: the check the engine makes
    at load, without loading. ``fits``; ``backend`` (``"auto"`` resolved); ``limit`` and ``limit_is`` (bytes and
    what they are; ``None`` for the CPU); when it fits ``max_seq`` (as asked, or fitted to the device when none
    was), ``note``, ``bytes`` (``weights``, ``delta_net_state``, ``kv_cache``, ``activations``, ``total``),
    ``kv_dtype`` and ``describe``; else ``error``, the message loading would raise."""
