"""Aggregate decode speed of ``lily serve`` with 1, 2, 4, ... clients streaming at once (the scheduler's
continuous batch), against the same server serving one client.

    python benchmarks/serve_concurrency.py CHECKPOINT [--levels 1,2,4] [--prompt 128] [--gen 64] [--backend cpu]

Each level starts its clients together; each streams a completion of a different prompt of about
``--prompt`` tokens, exactly ``--gen`` tokens long (the eos ids are biased away). Reported per level:
aggregate tok/s (all generated tokens over the wall time from the first request to the last token, so
prefills are included), the aggregate decode tok/s while every stream decodes (tokens streamed between the
last stream's first token and the first stream's last one, over that time), the mean time to first token.
Runs the server in this process on a free loopback port; the prefix cache is off so every prompt is
prefilled.
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
import time

import lily
from lily.server import Server


def stream(server: Server, prompt: str, gen: int, bias: dict[str, float], out: dict) -> None:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=3600)
    body = {"prompt": prompt, "max_tokens": gen, "temperature": 0, "stream": True, "logit_bias": bias}
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(resp.read().decode())
    times = [time.perf_counter() for line in resp if line.startswith(b"data: {")]  # one event per token with text
    out.update(start=t0, times=times)
    conn.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--levels", default="1,2,4", help="numbers of concurrent clients (default 1,2,4)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per client (about)")
    ap.add_argument("--gen", type=int, default=64, help="tokens generated per client")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--max-seq", type=int, default=4096)
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    model = lily.load(args.checkpoint, backend=args.backend, max_seq=args.max_seq, prefix_cache_bytes=0)
    server = Server(model, "127.0.0.1", 0, max_sequences=max(levels)).start()
    bias = {str(i): -100.0 for i in model.eos_ids}
    words = "the of and to in is that for it as with was on be by at this from or an".split()
    print(f"# {model.engine.backend}, {model.engine.device}; prompt ~{args.prompt} tokens, {args.gen} generated")
    print("| clients | aggregate tok/s | vs 1 | aggregate decode tok/s | vs 1 | mean TTFT s |")
    print("|---:|---:|---:|---:|---:|---:|")
    base = base_decode = None
    try:
        for run, n in enumerate([1, *levels]):  # a warm-up at 1 first
            prompts = [f"Client {run}.{i}: " + " ".join(words[(i + k) % len(words)] for k in range(args.prompt))
                       for i in range(n)]
            outs: list[dict] = [{} for _ in range(n)]
            threads = [threading.Thread(target=stream, args=(server, p, args.gen, bias, o))
                       for p, o in zip(prompts, outs)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if run == 0:
                continue
            tokens = sum(len(o["times"]) for o in outs)
            wall = max(o["times"][-1] for o in outs) - min(o["start"] for o in outs)
            agg = tokens / wall
            lo, hi = max(o["times"][0] for o in outs), min(o["times"][-1] for o in outs)
            inside = sum(lo < t <= hi for o in outs for t in o["times"])
            decode = inside / (hi - lo)
            base, base_decode = base or agg, base_decode or decode
            ttft = sum(o["times"][0] - o["start"] for o in outs) / n
            print(f"| {n} | {agg:.2f} | {agg / base:.2f}x | {decode:.2f} | {decode / base_decode:.2f}x | {ttft:.2f} |",
                  flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
