"""Per-token cost of structured output (a grammar mask) at the real vocabulary.

Each step the sampler waits for the grammar's mask of the allowed ids, draws among them and commits the
token; the mask for the next step is then computed on the constraint's own thread while the model runs.
Logits steer the draw along a target document (its next token gets a high logit), so the masks are
those of a realistic output. Printed per token, median and 90th percentile:

- ``mask``: the mask computed with nothing to overlap (sample right after the previous commit): the
  whole cost of the grammar, as on a backend that leaves no time between tokens;
- ``overhead``: the time a step takes beyond an unconstrained ``Sampler.sample`` when a forward pass of
  ``--forward-ms`` runs between steps (a sleep here: the engine releases the GIL and, on a GPU, the
  CPU) — what structured output adds to the token loop. The budget is 0.5 ms.

    python benchmarks/constraint_overhead.py [--tokenizer DIR] [--forward-ms 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from lily._lily import Vocab
from lily.sampling import Sampler
from lily.structured import Grammar, tool_call_grammar
from lily.tokenizer import Tokenizer
from lily.tokenizer_files import write_qwen_tokenizer

VOCAB = 248_320
BUDGET_MS = 0.5

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "active"],
}
DOCUMENT = json.dumps({
    "name": "Ada Lovelace, Countess of Lovelace", "age": 36, "email": "ada@example.org",
    "tags": ["mathematics", "analytical engine", "poetry of science", "notes on the Bernoulli numbers"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"}, "active": False,
}, separators=(", ", ": "))
TOOLS = [{"type": "function", "function": {"name": "edit_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "line": {"type": "integer"},
                                     "text": {"type": "string"}}, "required": ["path", "text"]}}}]
TOOL_CALL = ("<tool_call>\n<function=edit_file>\n<parameter=path>\nsrc/lily/server.py\n</parameter>\n"
             "<parameter=line>\n42\n</parameter>\n<parameter=text>\n    return await send(event)  # keep the order\n"
             "</parameter>\n</function>\n</tool_call>")


def run(vocab, tok, grammar: Grammar, target: list[int], forward_s: float, rng) -> tuple[list[float], list[float]]:
    """(mask-wait + sample ms per token without overlap, constrained minus plain sample ms with overlap)"""
    base = rng.normal(0.0, 2.5, VOCAB).astype(np.float32)
    rows = []
    for t in target:
        row = base.copy()
        row[t] = 40.0
        rows.append(row)
    plain = Sampler(temperature=0.0, vocab_limit=len(tok))
    cold, warm = [], []
    for overlap in (False, True):
        c = vocab.constrain(grammar.kind, grammar.source)
        for row, want in zip(rows, target):
            if overlap:
                time.sleep(forward_s)  # the forward pass: the mask thread runs meanwhile
            t0 = time.perf_counter()
            plain.sample(row)
            t1 = time.perf_counter()
            token, _ = plain.sample(row, constraint=c)
            t2 = time.perf_counter()
            if token != want:
                raise SystemExit(f"the grammar refused token {want} ({tok.decode([want])!r}) of the target")
            (warm if overlap else cold).append(((t2 - t1) - (t1 - t0) if overlap else (t2 - t1)) * 1e3)
    return cold, warm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=None, metavar="DIR",
                    help="folder with a tokenizer.json (default: the Qwen3.6 tokenizer shipped with lily)")
    ap.add_argument("--forward-ms", type=float, default=15.0, help="simulated forward pass between steps")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.tokenizer or Path(tmp)
        if args.tokenizer is None:
            write_qwen_tokenizer(folder)
        tok = Tokenizer.from_file(folder / "tokenizer.json", eos_ids=[248_046, 248_044])
    table = [tok.token_bytes(i) for i in range(len(tok))]
    t0 = time.perf_counter()
    vocab = Vocab(table, special=sorted(tok.special_ids), eos=sorted(tok.eos_ids), rows=VOCAB)
    print(f"token table: {time.perf_counter() - t0:.2f} s (once per model)")
    rng = np.random.default_rng(0)
    cases = [
        ("json_schema", Grammar.json_schema(SCHEMA), DOCUMENT),
        ("tool call", tool_call_grammar(TOOLS, choice="required"), TOOL_CALL),
    ]
    for name, grammar, text in cases:
        target = tok.encode(text) + [248_046]
        cold, warm = [], []
        for _ in range(args.repeats):
            c, w = run(vocab, tok, grammar, target, args.forward_ms / 1e3, rng)
            cold += c
            warm += w

        def q(v, p):
            return statistics.quantiles(v, n=10)[8] if p == 90 else statistics.median(v)

        print(f"{name:12s} {len(target)} tokens: mask {q(cold, 50):.3f} ms median, {q(cold, 90):.3f} ms p90 | "
              f"overhead with a {args.forward_ms:g} ms forward pass {q(warm, 50):.3f} ms median, "
              f"{q(warm, 90):.3f} ms p90 (budget {BUDGET_MS} ms)")


if __name__ == "__main__":
    main()
