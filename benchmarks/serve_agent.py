"""Time to first token and decode speed of ``lily serve`` for a coding agent's ~10K-token prompt, cold
and with prefix reuse, through the Anthropic Messages API as Claude Code calls it (streaming).

The prompt is an agent's: a system prompt, tool definitions, and a history in which the agent read
source files of this repository (tool results), ending with a question. Turn 1 is cold (nothing in the
engine). Turn 2 is the next request of the same session: the same history plus the assistant's reply and
a new question, which reuses the engine state of turn 1 (reported as ``cache_read_input_tokens``).

    python benchmarks/serve_agent.py CHECKPOINT [--tokens 10000] [--gen 64] [--backend cpu]

TTFT is measured by the client, from sending the request to the first streamed token; decode tok/s over
the tokens after the first. Runs the server in this process on a free loopback port.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import anthropic
import lily
from lily.server import Server

ROOT = Path(__file__).resolve().parent.parent
TOOLS = [
    {"name": "read_file", "description": "Read a file of the repository.",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
    {"name": "edit_file", "description": "Replace text in a file.",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}, "old": {"type": "string"},
                                                       "new": {"type": "string"}},
                      "required": ["path", "old", "new"]}},
    {"name": "run", "description": "Run a shell command in the repository and return its output.",
     "input_schema": {"type": "object", "properties": {"command": {"type": "string"},
                                                       "timeout_s": {"type": "integer"}},
                      "required": ["command"]}},
]
SYSTEM = ("You are a coding agent working in the Lily repository (a Rust + Python inference engine). Read files "
          "before you edit them, keep changes small, run the tests after each change, and explain what you did.")


def history(model: lily.Model, target: int) -> list[dict]:
    """User question, then read_file calls and results over this repository's sources up to ~target tokens."""
    messages: list[dict] = [{"role": "user", "content": "Why does the server cancel a generation when a client "
                                                        "disconnects? Read the relevant code first."}]
    files = sorted((ROOT / "python" / "lily").rglob("*.py")) + sorted((ROOT / "crates").rglob("*.rs"))
    used = 0
    for i, path in enumerate(files):
        if used >= target:
            break
        text = path.read_text(encoding="utf-8")
        call_id = f"toolu_{i:04d}"
        rel = str(path.relative_to(ROOT))
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": f"Let me read {rel}."},
            {"type": "tool_use", "id": call_id, "name": "read_file", "input": {"path": rel}}]})
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id,
                                                      "content": text}]})
        used += len(model.tokenizer.encode(text)) + 40
    messages.append({"role": "user", "content": "Now summarise how cancellation works, in three sentences."})
    return messages


def turn(client: anthropic.Anthropic, messages: list[dict], gen: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    deltas = 0
    with client.messages.stream(model="bench", max_tokens=gen, system=SYSTEM, tools=TOOLS, messages=messages,
                                thinking={"type": "disabled"}) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                now = time.perf_counter()
                first = first or now
                last = now
                deltas += 1
        final = stream.get_final_message()
    out = final.usage.output_tokens
    return {"ttft_s": (first or time.perf_counter()) - t0,
            "decode_tok_s": (out - 1) / (last - first) if first and last and last > first and out > 1 else 0.0,
            "prompt_tokens": final.usage.input_tokens + final.usage.cache_read_input_tokens,
            "cached_tokens": final.usage.cache_read_input_tokens, "output_tokens": out, "message": final}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--tokens", type=int, default=10_000, help="approximate prompt length")
    ap.add_argument("--gen", type=int, default=64, help="tokens generated per turn")
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args()
    model = lily.load(args.checkpoint, backend=args.backend, max_seq=args.tokens + 4 * args.gen + 4096,
                      progress=False)
    server = Server(model, "127.0.0.1", 0, model_id="bench").start()
    try:
        client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=3600)
        messages = history(model, args.tokens)
        cold = turn(client, messages, args.gen)
        reply = [b.model_dump() for b in cold["message"].content if b.type == "text"] or [
            {"type": "text", "text": "Done."}]
        messages2 = [*messages, {"role": "assistant", "content": reply},
                     {"role": "user", "content": "And what happens to a request still waiting in the queue?"}]
        warm = turn(client, messages2, args.gen)
    finally:
        server.stop()
    print(f"machine: {platform.machine()} {platform.processor() or ''}, backend {model.engine.backend}, "
          f"checkpoint {Path(args.checkpoint).name}")
    print("| request | prompt tokens | reused | TTFT (s) | decode tok/s |")
    print("|---|---:|---:|---:|---:|")
    for name, r in (("cold", cold), ("next turn (prefix reuse)", warm)):
        print(f"| {name} | {r['prompt_tokens']:,} | {r['cached_tokens']:,} | {r['ttft_s']:.2f} | "
              f"{r['decode_tok_s']:.1f} |")


if __name__ == "__main__":
    main()
