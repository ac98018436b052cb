"""Worst stall of running streams while a near-context-length prompt joins (issue 14: chunked prefill).

Starts ``eyas serve`` (unless --url is given) and runs the same scene twice: --streams streaming chat
completions, and once all are producing tokens, one long prompt (--long-tokens tokens of text) joins; the
control run sends no long prompt. A stream's inter-token latency grows as its own context grows
(attention), so the normal latency a gap is compared with is the control run's median gap over the same
window (from the join to the long prompt's first token); the median gap before the join is printed too.
Writes the figures as JSON.

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


def stream(client: OpenAI, prompt: str, max_tokens: int, stamps: list[float], stop: threading.Event | None = None):
    r = client.chat.completions.create(model="eyas", messages=[{"role": "user", "content": prompt}],
                                       max_tokens=max_tokens, temperature=0, stream=True)
    for chunk in r:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
        if stop is not None and stop.is_set():
            r.close()  # the server cancels the request
            return


def scene(client: OpenAI, a, long_prompt: str | None, window: float | None) -> dict:
    """Run the streams; with ``long_prompt``, join it once every stream has 20 tokens. Returns the gaps (s) before
    the join and in the window after it (until the long prompt's first token, or ``window`` seconds).
    """
    stamps, stop = [[] for _ in range(a.streams)], threading.Event()
    threads = [threading.Thread(target=stream, args=(client, f"Tell a long story number {i} about a lighthouse.",
                                                     a.max_tokens, stamps[i], stop)) for i in range(a.streams)]
    for t in threads:
        t.start()
    while min(len(s) for s in stamps) < 20:
        time.sleep(0.05)
    joined = time.perf_counter()
    if long_prompt is not None:
        long_stamps: list[float] = []
        stream(client, long_prompt, 8, long_stamps)
        end = long_stamps[0] if long_stamps else time.perf_counter()
    else:
        time.sleep(window)
        end = joined + window
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join()
    gaps = [(b - a_, b) for s in stamps for a_, b in zip(s, s[1:], strict=False)]
    during = [(g, b - joined) for g, b in gaps if joined <= b <= end]
    finished_early = sum(1 for s in stamps if s[-1] < end)
    return {"before": [g for g, b in gaps if b < joined], "during": during, "ttft": end - joined,
            "streams_done_before_end": finished_early}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=None)
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--long-tokens", type=int, default=7800, help="approximate length of the joining prompt")
    ap.add_argument("--max-tokens", type=int, default=1500, help="per stream: long enough to outlast the join")
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
        long_prompt = "Summarise this text. " + " ".join(["The quick brown fox jumps over the lazy dog."] *
                                                         (a.long_tokens // 10))
        join = scene(client, a, long_prompt, None)
        control = scene(client, a, None, join["ttft"])
        during = sorted(g for g, _ in join["during"])
        normal = statistics.median(g for g, _ in control["during"])
        before = statistics.median(join["before"])
        worst, worst_at = max(join["during"])
        res = {"streams": a.streams, "long_prompt_chars": len(long_prompt),
               "long_prompt_ttft_s": join["ttft"],
               "itl_median_control_ms": 1000 * normal,
               "itl_median_before_join_ms": 1000 * before,
               "worst_gap_during_join_ms": 1000 * worst, "worst_gap_at_s": worst_at,
               "gaps_during_join": len(during),
               "p50_gap_during_join_ms": 1000 * during[len(during) // 2],
               "p99_gap_during_join_ms": 1000 * during[int(len(during) * 0.99)],
               "streams_done_before_end": join["streams_done_before_end"],
               "ratio": worst / normal, "ratio_vs_before_join": worst / before}
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
