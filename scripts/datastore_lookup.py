"""Would lookup in a datastore of the target's own answers (REST, He et al. 2023) add to the head and prompt lookup?

The datastore is every assistant answer of the self-distillation files (the target's greedy text), tokenized and
indexed by hashed n-grams (n = 8, 6, 4, 3, 2). At a drafting position the longest suffix of the text found there
gives a chain: at each depth the token most of the matches continue with, its probability the fraction that agree
(times ``--scale``). MT-Bench-101 records are left out: the tuning questions are MT-Bench-101 first turns, and the
commercial file holds their answers.

``offline``: along the target's greedy answers to the tuning questions, the accepted length of three top-1 chains
at every position (the head teacher-forced as in scripts/acceptance_profile.py, prompt lookup, the datastore) and of
their best, by matched n. ``ab``: the datastore's chain grafted into the default drafter's tree as one more lookup
chain (eyas.tree.merge), on and off alternating per question in one process; decode tok/s and pooled tau.
``--mode extend`` grafts only the part past the head's candidates (where the head stopped drafting).

python scripts/tune_questions.py --out /tmp/tune.jsonl
python scripts/datastore_lookup.py offline --questions /tmp/tune.jsonl --limit 24
python scripts/datastore_lookup.py ab --questions /tmp/tune.jsonl --limit 24 [--min-n 4 --scale 0.5 --floor 0.2]
"""

from __future__ import annotations

import argparse
import glob
import json
import lzma
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from eyas.train.profile import ranks_along, top1_chains

sys.path.insert(0, str(Path(__file__).resolve().parent))
from head_ab import Arm  # noqa: E402

NS = (8, 6, 4, 3, 2)
MUL, MASK = 1000003, (1 << 64) - 1
DATA = "data/selfdistill/smollm2-135m-instruct-"


class Datastore:
    """Hashed n-gram index over the answers of ``files`` (sorted keys and positions per n, built in ~30 s)."""

    def __init__(self, tok, files: list[str], exclude: set[str], depth: int = 6, sample: int = 48) -> None:
        texts = []
        for f in files:
            with (lzma.open if f.endswith(".xz") else open)(f, "rt") as fh:
                for line in fh:
                    r = json.loads(line)
                    if r.get("source") not in exclude:
                        texts += [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        os.environ["TOKENIZERS_PARALLELISM"] = "true"
        end = tok.convert_tokens_to_ids("<|im_end|>")
        ids = tok(texts, add_special_tokens=False)["input_ids"]
        self.ds = ds = np.concatenate([np.asarray(e + [end, -1], dtype=np.int64) for e in ids])  # -1: a boundary
        self.depth, self.sample, self.index = depth, sample, {}
        for n in NS:
            h, bad = np.zeros(ds.size, dtype=np.int64), np.zeros(ds.size, dtype=bool)
            with np.errstate(over="ignore"):
                for j in range(n - 1, -1, -1):  # h[i] hashes ds[i - n + 1 .. i], oldest first
                    shifted = np.roll(ds, j)
                    h, bad = h * np.int64(MUL) + shifted + 7, bad | (shifted < 0)
            bad[: n - 1] = True
            bad |= np.roll(ds, -1) < 0  # no token after it
            pos = np.nonzero(~bad)[0]
            order = np.argsort(h[pos], kind="stable")
            self.index[n] = (h[pos][order], pos[order])

    def chain(self, toks: list[int], min_n: int = 2) -> tuple[list[int], list[float], int]:
        """(tokens, agreement fractions, matched n) continuing the longest indexed suffix of ``toks``."""
        for n in NS:
            if n > len(toks) or n < min_n:
                continue
            v = 0
            for x in toks[-n:]:
                v = (v * MUL + x + 7) & MASK
            key = v - (1 << 64) if v >= 1 << 63 else v
            keys, pos = self.index[n]
            lo = int(np.searchsorted(keys, key, "left"))
            if lo == keys.size or keys[lo] != key:
                continue
            hi = int(np.searchsorted(keys, key, "right"))
            starts = pos[lo : min(hi, lo + self.sample)]
            rows = self.ds[np.minimum(starts[:, None] + 1 + np.arange(self.depth), self.ds.size - 1)].tolist()
            out, fracs = [], []
            for d in range(self.depth):
                counts: dict[int, int] = {}
                for r in rows:
                    if r[d] >= 0:
                        counts[r[d]] = counts.get(r[d], 0) + 1
                if not counts:
                    break
                best = max(counts, key=counts.get)
                out.append(best)
                fracs.append(counts[best] / len(rows))
                rows = [r for r in rows if r[d] == best]
            return out, fracs, n
        return [], [], 0


def accepted(chain: list[int], truth: list[int]) -> int:
    n = 0
    for c, t in zip(chain, truth, strict=False):
        if c != t:
            break
        n += 1
    return n


def offline(a, spec, store: Datastore, qs: list[str]) -> None:
    from eyas.drafters.ngram import NgramConfig, find_continuations
    from eyas.formats.eagle3 import load_eagle3

    target = spec.target.model
    head = load_eagle3(Path(a.head), target.config, target.dtype).float()
    rows = []
    for q in qs:
        prompt = spec.encode(q)
        answer = spec.generate(q, max_new_tokens=a.max_new_tokens, speculate=False).token_ids
        ids = torch.cat([prompt, torch.tensor(answer, dtype=torch.long)])
        first, x = prompt.shape[0] - 1, ids.tolist()
        chains = top1_chains(ranks_along(target, head, ids, a.depth), first).tolist()  # [positions]
        for t in range(first, len(x) - 2):  # the root is x[t + 1]; drafts are x[t + 2 ...]
            truth, ctx, h = x[t + 2 : t + 2 + a.depth], x[: t + 2], chains[t - first]
            conts = find_continuations(torch.tensor(ctx), NgramConfig(max_ngram=3, min_ngram=1, num_draft=a.depth))
            look = accepted(conts[0].tolist(), truth) if conts else 0
            chain, _, n = store.chain(ctx, a.min_n)
            rows.append((h, look, accepted(chain, truth), n))
    r = np.array(rows)
    both, three = np.maximum(r[:, 0], r[:, 1]), np.maximum(np.maximum(r[:, 0], r[:, 1]), r[:, 2])
    print(f"{len(r)} positions; mean accepted top-1 chain: head {r[:, 0].mean():.3f}, prompt lookup "
          f"{r[:, 1].mean():.3f}, datastore {r[:, 2].mean():.3f}; best of head and lookup {both.mean():.3f}, "
          f"of all three {three.mean():.3f}")
    print(f"depth 1: head right {(r[:, 0] > 0).mean():.3f}, datastore right {(r[:, 2] > 0).mean():.3f}, datastore "
          f"right where the head is wrong {((r[:, 2] > 0) & (r[:, 0] == 0)).mean():.3f}")
    for n in NS:
        m = r[:, 3] == n
        if m.any():
            print(f"  matched n={n}: {m.sum()} positions, datastore depth-1 {(r[m, 2] > 0).mean():.3f}, head "
                  f"{(r[m, 0] > 0).mean():.3f}, gain of the best of three {(three - both)[m].mean():.3f}")


def ab(a, spec, store: Datastore, qs: list[str]) -> None:
    import eyas.drafters.hybrid as hybrid
    from eyas.tree.merge import Chain

    merge, state = hybrid.merge_candidates, {"on": False, "drafter": None, "lookup_s": 0.0, "calls": 0}

    def graft(base, chains, budget, size=None):
        if state["on"]:
            t0 = time.perf_counter()
            toks, fracs, _ = store.chain(state["drafter"].index.tokens, a.min_n)
            state["lookup_s"] += time.perf_counter() - t0
            state["calls"] += 1
            lps = [math.log(a.scale * f) for f in fracs]
            cut = next((i for i, lp in enumerate(lps) if lp < math.log(a.floor)), len(lps))
            toks, lps = toks[:cut], lps[:cut]
            if a.mode == "extend":  # only past the head's candidates: the matched prefix keeps the head's scores
                bp, bt = (x.tolist() if torch.is_tensor(x) else list(x) for x in (base.parents, base.tokens))
                child = {(p, t): i for i, (p, t) in enumerate(zip(bp, bt, strict=True)) if i}
                parents, node, keep = set(bp), 0, []
                for tok, lp in zip(toks, lps, strict=True):
                    if node is not None and (node, tok) in child:
                        node = child[(node, tok)]
                        keep.append(-1e9)
                    elif node is not None and node in parents:
                        break  # the head drafted other tokens here
                    else:
                        node = None
                        keep.append(lp)
                toks, lps = toks[: len(keep)], keep
            if toks:
                chains = [*chains, Chain(toks, lps)]
        return merge(base, chains, budget, size)

    propose = hybrid.HybridDrafter.propose

    def tracked(self, history, sampling, generator=None):
        state["drafter"] = self
        return propose(self, history, sampling, generator)

    hybrid.merge_candidates, hybrid.HybridDrafter.propose = graft, tracked
    spec.generate(qs[0], max_new_tokens=16)
    spec.generate(qs[0], max_new_tokens=16, speculate=False)
    arms = {k: Arm(k) for k in ("off", "on", "plain")}
    for i, q in enumerate(qs):
        for name in (("off", "on") if i % 2 == 0 else ("on", "off")) + ("plain",):
            state["on"] = name == "on"
            arms[name].add(spec.generate(q, max_new_tokens=a.max_new_tokens, speculate=name != "plain"))
    for arm in arms.values():
        print(f"{arm.name:6s} decode {arm.tok_s:6.1f} tok/s  tau {arm.tau:.3f}")
    print(f"on / off {arms['on'].tok_s / arms['off'].tok_s:.3f}; lookup "
          f"{1e3 * state['lookup_s'] / max(state['calls'], 1):.3f} ms a step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("offline", "ab"))
    ap.add_argument("--questions", required=True)
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--data", action="append", default=None,
                    help=f"datastore files (default: {DATA}commercial.jsonl and every Magpie file)")
    ap.add_argument("--exclude-source", action="append", default=["mt_bench_101"])
    ap.add_argument("--head", default="eyas/heads/smollm2-135m-instruct-eagle3")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--min-n", type=int, default=2, help="shortest suffix looked up")
    ap.add_argument("--scale", type=float, default=0.6, help="a chain token's probability: scale x agreement")
    ap.add_argument("--floor", type=float, default=0.02, help="chains stop below this probability")
    ap.add_argument("--mode", choices=("all", "extend"), default="all")
    a = ap.parse_args()
    import eyas

    spec = eyas.load(dtype="bfloat16", **({"drafter": "none"} if a.what == "offline" else {}))
    files = a.data or [f"{DATA}commercial.jsonl", *sorted(glob.glob(f"{DATA}magpie-*.jsonl.xz"))]
    t0 = time.time()
    store = Datastore(spec.tokenizer, files, set(a.exclude_source), a.depth)
    print(f"datastore: {store.ds.size:,} tokens from {len(files)} files, indexed in {time.time() - t0:.0f} s")
    qs = [json.loads(line)["turns"][0] for line in open(a.questions)][: a.limit]
    (offline if a.what == "offline" else ab)(a, spec, store, qs)


if __name__ == "__main__":
    main()
