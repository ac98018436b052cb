"""Replay the shipped drafter over greedy texts and compare fixed EAGLE-2 trees with adaptive ones (eyas.tree.budget)
on a cost table: predicted tokens/s over plain, and τ, without timing anything (tuning questions only).

At every answer position the drafter drafts its full candidate set (top-k, depth ``--depth``) over the target's own
greedy text; a fixed tree keeps the first levels and the best-ranked candidates, an adaptive one feeds levels while
the frontier's path probabilities sum to >= feed and keeps what its prices pay for (``StepBudget``, the rule decoding
runs). Greedy verification accepts the longest kept path the text follows, and decoding's trajectory is replayed
(eyas.tree_replay). Step cost = forward(nodes) + per_step + levels fed * (per_level + k * per_node), from the machine's
cached table (eyas.autotree) unless ``--costs`` gives one. ``--policy-costs``: size the trees (the fixed pick and the
adaptive budget) on another table and replay them on ``--costs``: what a mis-timed table costs.

python scripts/tune_questions.py --out /tmp/tune.jsonl
python scripts/adaptive_replay.py --questions /tmp/tune.jsonl --limit 24
python scripts/adaptive_replay.py --questions /tmp/tune.jsonl --limit 24 --costs good.json --policy-costs noisy.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch


def replay_books(spec, drafter, questions: list[str], max_new_tokens: int, depth: int) -> list[list[tuple]]:
    """Per text, per answer position: (depth, key, true path, keys by depth) of the drafter's full candidates."""
    from tqdm import tqdm

    from eyas.tree_replay import draft_along, text_features

    texts = []
    for q in tqdm(questions, desc="replaying"):
        prompt = spec.encode(q)
        answer = spec.generate(q, max_new_tokens=max_new_tokens, speculate=False).token_ids
        ids = torch.cat([prompt, torch.tensor(answer, dtype=torch.long)])
        feats = text_features(spec.target.model, ids, drafter.taps)
        texts.append([position(b, truth[:depth]) for b, truth in draft_along(drafter, ids, prompt.shape[0], feats)])
    return texts


def position(builder, truth: list[int]):
    """(depth, key, true path slots, keys by depth, best first) of one position's candidates."""
    from eyas.tree_replay import true_path

    tok, par, _ = builder.candidates()
    depth = [0] * len(tok)
    for s in range(1, len(tok)):  # a parent's slot is below its children's
        depth[s] = depth[par[s]] + 1
    key = [math.inf, *builder.keys(list(range(1, len(tok))))]
    by_depth: dict[int, list[float]] = {}
    for s in range(1, len(tok)):
        by_depth.setdefault(depth[s], []).append(key[s])
    for keys in by_depth.values():
        keys.sort(reverse=True)
    return depth, key, true_path(tok, par, truth), by_depth


def replay(texts, choose, cost, draft, k: int) -> tuple[float, float]:
    """(τ, tokens per second) of decoding every text with ``choose(depth, key, by_depth) -> (levels, kept)``."""
    from eyas.tree.sizing import interpolate

    tokens = steps = 0
    seconds = 0.0
    for pos in texts:
        j = 0
        while j < len(pos):
            depth, key, path, by_depth = pos[j]
            levels, kept = choose(depth, key, by_depth)
            ranked = sorted((s for s in range(1, len(depth)) if depth[s] <= levels), key=lambda s: (-key[s], s))
            keep = set(ranked[:kept])
            accepted = next((i for i, s in enumerate(path) if s not in keep or depth[s] > levels), len(path))
            new = min(accepted + 1, len(pos) - j)
            tokens, steps, j = tokens + new, steps + 1, j + new
            drafting = draft.per_step + (levels - 1) * (draft.per_level + k * draft.per_node)
            seconds += interpolate(cost, kept + 1) + drafting
    return tokens / steps, tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", required=True)
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--costs", default=None, help="a tree_costs JSON (default: this machine's, measured if missing)")
    ap.add_argument("--policy-costs", default=None, help="a tree_costs JSON to size the trees on (default: --costs)")
    a = ap.parse_args()
    import eyas
    from eyas.autotree import adaptive_max_total, head_dir_of, load_profile, machine_costs
    from eyas.drafters.eagle3 import Eagle3Drafter
    from eyas.drafters.loading import DrafterSpec
    from eyas.tree.dynamic import DynamicTreeConfig
    from eyas.tree.sizing import DraftCost, choose_tree, interpolate, step_budget

    spec = eyas.load(dtype="bfloat16", drafter="none")
    head_dir = head_dir_of(spec.target, DrafterSpec("hybrid"))
    def read(path: str) -> tuple[dict, DraftCost]:
        d = json.load(open(path))
        return {int(w): s for w, s in d["step_seconds"].items()}, DraftCost(**d["draft"])

    cost, draft = read(a.costs) if a.costs else machine_costs(spec.target, head_dir, True, hybrid=True)
    priced, priced_draft = read(a.policy_costs) if a.policy_costs else (cost, draft)
    profile = load_profile(head_dir)
    # what eyas.autotree picks and prices for the default, on the policy's table
    choice = choose_tree(priced, priced_draft, profile, max_nodes=32)
    budget = step_budget(choice, priced, priced_draft, profile, adaptive_max_total(choice, 32))
    most_total = budget.max_total
    k = budget.top_k
    most = DynamicTreeConfig(k, a.depth, 1).max_candidates
    drafter = Eagle3Drafter(target_model=spec.target.model, path=head_dir, tree=f"dynamic:{k},{a.depth},{most}")
    qs = [json.loads(line)["turns"][0] for line in open(a.questions)][: a.limit]
    texts = replay_books(spec, drafter, qs, a.max_new_tokens, a.depth)
    plain = 1.0 / interpolate(cost, 1)

    def fixed(d: int, t: int):
        return lambda depth, key, by_depth: (d, t)

    def adaptive(depth, key, by_depth):
        levels = 1  # a level's frontier: its k best candidates, what EAGLE-2 feeds next
        while levels < a.depth and by_depth.get(levels) and budget.keep_feeding(by_depth[levels][:k]):
            levels += 1
        keys = sorted((key[s] for s in range(1, len(depth)) if depth[s] <= levels), reverse=True)
        return levels, budget.total(keys[: budget.max_total])

    rows = [(f"dynamic:{k},{d},{t}", *replay(texts, fixed(d, t), cost, draft, k))
            for d in range(1, a.depth + 1) for t in range(1, most_total + 1)
            if t <= DynamicTreeConfig(k, d, 1).max_candidates]
    rows.sort(key=lambda r: -r[2])
    print(f"{len(texts)} texts, plain {plain:.1f} tok/s on the table; the sizer's fixed pick {choice.fixed_spec}")
    for name, tau, rate in [(budget.spec, *replay(texts, adaptive, cost, draft, k)), *rows[:5]]:
        print(f"{rate / plain:6.3f}x  tau {tau:.3f}  {name}")


if __name__ == "__main__":
    main()
