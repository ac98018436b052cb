"""Worst stall of running streams while a near-context-length prompt joins (issue 14: chunked prefill).

Starts ``eyas serve`` (unless --url is given), opens --streams streaming chat completions, and once
all are producing tokens sends one long prompt (--long-tokens tokens of text). Prints the running
streams' median inter-token gap before the join and the worst gap while the long prompt is
prefilled, and writes them as JSON.

python scripts/prefill_stall.py --json docs/results/prefill_stall.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

import httpx
from openai import OpenAI


def stream(client: OpenAI, prompt: str, max_tokens: int, stamps: list[float]) -> None:
    r = client.chat.completions.create(model="eyas", messages=[{"role": "user", "content": prompt}],
                                       max_tokens=max_tokens, temperature=0, stream=True)
    for chunk in r:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=None)
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--long-tokens", type=int, default=7800, help="approximate length of the joining prompt")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    server = None
    url = a.url
    if url is None:
        url = f"http://127.0.0.1:{a.port}"
        server = subprocess.Popen([sys.executable, "-m", "eyas", "serve", "--port", str(a.port), "--max-batch", "16",
                                   "--served-model-name", "eyas"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(600):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    try:
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900)
        stamps = [[] for _ in range(a.streams)]
        threads = [threading.Thread(target=stream, args=(client, f"Tell a long story number {i} about a lighthouse.",
                                                         a.max_tokens, stamps[i])) for i in range(a.streams)]
        for t in threads:
            t.start()
        while min(len(s) for s in stamps) < 20:
            time.sleep(0.05)
        joined = time.perf_counter()
        long_prompt = "Summarise this text. " + " ".join(["The quick brown fox jumps over the lazy dog."] *
                                                         (a.long_tokens // 10))
        long_stamps: list[float] = []
        lt = threading.Thread(target=stream, args=(client, long_prompt, 8, long_stamps))
        lt.start()
        lt.join()
        first_long = long_stamps[0] if long_stamps else time.perf_counter()
        for t in threads:
            t.join()
        before = [b - a_ for s in stamps for a_, b in zip(s, s[1:], strict=False) if b < joined]
        during = [b - a_ for s in stamps for a_, b in zip(s, s[1:], strict=False) if joined <= b <= first_long + 0.5]
        res = {"streams": a.streams, "long_prompt_chars": len(long_prompt),
               "long_prompt_ttft_s": first_long - joined,
               "itl_median_before_ms": 1000 * statistics.median(before),
               "worst_gap_during_join_ms": 1000 * max(during) if during else None,
               "ratio": (max(during) / statistics.median(before)) if during else None}
        print(json.dumps(res, indent=2))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=2)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
