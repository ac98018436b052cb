"""The speedup ceiling of this machine: speculative decoding with an oracle drafter.

The oracle knows the plain greedy output and proposes the next ``depth`` true tokens as a
chain, padded with wrong siblings under the root up to ``width`` tree nodes (root included),
so every step accepts exactly ``depth`` tokens (tau = depth + 1) and drafting costs nothing.
The measured speedup is therefore what the verify forward alone allows at that tau and tree
width; a real drafter's cost per step only lowers it. ``--draft-ms`` adds a fixed draft cost
per step to the estimate (tau * plain_ms / (step_ms + draft_ms)), e.g. the EAGLE-3 head's.

python scripts/oracle_ceiling.py [--questions F] [--limit 3] [--depths 1,2,3,4,6] [--width 9]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import eyas
from eyas.decode import DecodeConfig, SpecDecoder
from eyas.drafters.base import Drafter
from eyas.tree import make_tree
from eyas.types import DraftOutput


class OracleChain(Drafter):
    """Proposes the next ``depth`` tokens of a known continuation (plus junk up to ``width``)."""

    def __init__(self, continuation: list[int], prompt_len: int, depth: int, width: int, vocab: int) -> None:
        self.cont, self.prompt_len, self.depth, self.vocab = continuation, prompt_len, depth, vocab
        self.max_nodes = max(width, depth + 1)

    def propose(self, history, sampling, generator=None) -> DraftOutput:
        g = history.shape[0] - self.prompt_len  # tokens generated so far
        true = self.cont[g : g + self.depth]
        tokens, parents = [int(history[-1])], [-1]
        for i, tok in enumerate(true):  # the true chain
            tokens.append(tok)
            parents.append(len(tokens) - 2 if i else 0)
        junk = (true[0] if true else 0) + 1
        while len(tokens) < self.max_nodes:  # wrong first tokens under the root
            tokens.append(junk % self.vocab)
            parents.append(0)
            junk += 1
        return DraftOutput(tree=make_tree(torch.tensor(tokens), torch.tensor(parents)))


def timed(dec: SpecDecoder, prompt: torch.Tensor) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    out = [int(t) for ev in dec.generate(prompt) for t in ev.tokens]
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", default="../shared/data/mt_bench/question.jsonl")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--depths", default="1,2,3,4,6")
    ap.add_argument("--width", type=int, default=9, help="tree nodes per step, root included")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--draft-ms", type=float, default=0.0, help="draft cost per step added to the estimate")
    a = ap.parse_args()
    spec = eyas.load(drafter="ngram", dtype=a.dtype)  # the drafter is replaced by the oracle
    target = spec.target.model
    qs = [json.loads(line) for line in open(a.questions)][: a.limit]
    depths = [int(x) for x in a.depths.split(",")]
    plain_s = 0.0
    n_plain = 0
    spec_s = dict.fromkeys(depths, 0.0)
    steps = dict.fromkeys(depths, 0)
    accepted = dict.fromkeys(depths, 0)
    n_spec = dict.fromkeys(depths, 0)
    for q in qs:
        prompt = spec.encode(q["turns"][0])
        n = a.max_new_tokens
        long_cfg = DecodeConfig(max_new_tokens=n + max(depths) + 1)
        ref, _ = timed(SpecDecoder(target, None, long_cfg), prompt)  # warm-up + continuation
        _, s = timed(SpecDecoder(target, None, DecodeConfig(max_new_tokens=n)), prompt)
        plain_s += s
        n_plain += n
        for d in depths:
            oracle = OracleChain(ref, prompt.shape[0], d, a.width, target.config.vocab_size)
            dec = SpecDecoder(target, oracle, DecodeConfig(max_new_tokens=n))
            out, s = timed(dec, prompt)
            assert out == ref[:n], "oracle decoding changed the output"
            spec_s[d] += s
            steps[d] += dec.stats.steps
            accepted[d] += dec.stats.accepted
            n_spec[d] += len(out)
    plain_ms = 1000 * plain_s / n_plain
    print(f"plain: {plain_ms:.1f} ms/token ({a.dtype}, {torch.get_num_threads()} threads, {len(qs)} prompts)")
    print(f"{'tau':>5} {'width':>5} {'ms/step':>8} {'speedup':>8} {'with draft':>10}")
    for d in depths:
        step_ms = 1000 * spec_s[d] / max(steps[d], 1)
        tau = 1 + accepted[d] / max(steps[d], 1)
        ceiling = (n_spec[d] / spec_s[d]) / (n_plain / plain_s)
        est = tau * plain_ms / (step_ms + a.draft_ms)
        print(f"{tau:5.2f} {max(a.width, d + 1):5d} {step_ms:8.1f} {ceiling:7.2f}x {est:9.2f}x")


if __name__ == "__main__":
    main()
