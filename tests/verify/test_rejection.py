"""Sampling verification: seeded determinism and preservation of the target distribution.

The distribution tests use toy "language models" over a 5-token vocabulary: a
fixed random next-token distribution for every prefix. For each scenario the
first two emitted tokens (completed from the target when a step emits only one)
must follow the target's joint ``p(a | ()) * p(b | (a,))``, checked two ways:

* exactly, by enumerating every draft (weighted by q) and propagating the
  acceptance probabilities through an independent reference of the algorithm;
* by Monte Carlo over ``verify_sampling`` itself, with a chi-square test.
"""

from __future__ import annotations

import itertools
import random
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property

import pytest
import torch

from eyas.tree import make_tree
from eyas.types import DraftOutput, SamplingParams, Tree
from eyas.verify import logits_to_probs, rejection, sample, verify_greedy, verify_sampling

V = 5
CHAIN = [-1, 0, 1, 2]
TREE = [-1, 0, 0, 0, 1, 1]  # 3 children at the root, 2 under node 1
WIDE_TREE = [-1, 0, 0, 0, 1, 1, 2]
PLAIN = SamplingParams(temperature=1.0)
PROCESSED = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)


@dataclass
class ToyLM:
    """A fixed next-token distribution [V] (float32) for every prefix, memoised.

    The logits are ``1.5 * noise(seed) + noise_scale * noise(seed + 1000)``: a
    draft built from its target's seed plus a little noise of its own is a
    correlated draft, so the scenarios accept at every depth.
    """

    seed: int
    params: SamplingParams
    noise_scale: float = 0.0
    cache: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)

    def _noise(self, seed: int, prefix: tuple[int, ...]) -> torch.Tensor:
        for tok in prefix:
            seed = seed * (V + 1) + tok + 1
        return torch.randn(V, generator=torch.Generator().manual_seed(seed))

    def __call__(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self.cache:
            logits = 1.5 * self._noise(self.seed, prefix)
            if self.noise_scale:
                logits = logits + self.noise_scale * self._noise(self.seed + 1000, prefix)
            self.cache[prefix] = logits_to_probs(logits, self.params)
        return self.cache[prefix]


@dataclass
class Scenario:
    parents: list[int]
    stochastic: bool  # True: children drawn i.i.d. from q; False: distinct top-k of q, q=None
    target: ToyLM
    draft: ToyLM

    @cached_property
    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.parents]
        for i, par in enumerate(self.parents[1:], start=1):
            kids[par].append(i)
        return kids

    def prefix(self, tokens: tuple[int, ...], node: int) -> tuple[int, ...]:
        """Tokens on the path from the root (excluded) to node."""
        out: list[int] = []
        while node > 0:
            out.append(tokens[node])
            node = self.parents[node]
        return tuple(reversed(out))


SCENARIOS = {
    "chain-q": Scenario(CHAIN, True, ToyLM(1, PROCESSED), ToyLM(1, PLAIN, noise_scale=1.0)),
    "chain-point": Scenario(CHAIN, False, ToyLM(3, PLAIN), ToyLM(3, PLAIN, noise_scale=1.0)),
    "tree-iid-q": Scenario(
        TREE, True, ToyLM(5, PROCESSED), ToyLM(5, SamplingParams(1.0, top_k=3), noise_scale=1.0)
    ),
    "tree-topk-point": Scenario(WIDE_TREE, False, ToyLM(7, PROCESSED), ToyLM(7, PLAIN, noise_scale=1.0)),
}


def draft_tokens(sc: Scenario, rng: random.Random) -> tuple[int, ...]:
    tokens = [0]  # the root's token is irrelevant: prefixes start after it
    for i, par in enumerate(sc.parents[1:], start=1):
        q = sc.draft(sc.prefix(tuple(tokens), par))
        if sc.stochastic:
            tokens.append(rng.choices(range(V), weights=q.tolist())[0])
        else:  # the r-th child of a node gets the r-th most likely token
            rank = sc.children[par].index(i)
            tokens.append(int(torch.argsort(q, descending=True, stable=True)[rank]))
    return tuple(tokens)


def build(sc: Scenario, tokens: tuple[int, ...]) -> tuple[DraftOutput, torch.Tensor]:
    tree = make_tree(torch.tensor(tokens), torch.tensor(sc.parents))
    target_probs = torch.stack([sc.target(sc.prefix(tokens, i)) for i in range(len(tokens))])
    q = None
    if sc.stochastic:
        q = torch.stack([sc.draft(sc.prefix(tokens, max(par, 0))) for par in sc.parents])
    return DraftOutput(tree=tree, q=q), target_probs


def target_joint(sc: Scenario) -> torch.Tensor:
    """[V, V] float64 P(first = a, second = b) under the target."""
    first = sc.target(()).double()
    return torch.stack([first[a] * sc.target((a,)).double() for a in range(V)])


# ---------------------------------------------------------------------------
# exact enumeration through an independent reference of the algorithm


def _ref_outcomes(
    sc: Scenario, tokens: tuple[int, ...], node: int, need: int
) -> dict[tuple[int, ...], float]:
    """Exact distribution of the next ``need`` emitted tokens from ``node`` on."""
    prefix = sc.prefix(tokens, node)
    p = sc.target(prefix).double().tolist()
    out: dict[tuple[int, ...], float] = defaultdict(float)
    stay = 1.0  # probability that every child tried so far was rejected
    for c in sc.children[node]:
        x = tokens[c]
        q = sc.draft(prefix).double().tolist() if sc.stochastic else [float(t == x) for t in range(V)]
        accept = min(1.0, p[x] / q[x])
        if accept > 0:
            sub = {(): 1.0} if need == 1 else _ref_outcomes(sc, tokens, c, need - 1)
            for seq, pr in sub.items():
                out[(x,) + seq] += stay * accept * pr
        stay *= 1.0 - accept
        resid = [max(a - b, 0.0) for a, b in zip(p, q, strict=True)]
        p = [r / sum(resid) for r in resid] if sum(resid) > 0 else p
    for y, py in enumerate(p):
        nxt = [1.0] if need == 1 else sc.target(prefix + (y,)).double().tolist()
        for z, pz in enumerate(nxt):
            out[(y, z)[:need]] += stay * py * pz
    return out


def exact_joint(sc: Scenario) -> torch.Tensor:
    """[V, V] float64 exact distribution of the first two emitted tokens."""
    joint = torch.zeros(V, V, dtype=torch.float64)
    drafts = itertools.product(range(V), repeat=len(sc.parents) - 1) if sc.stochastic else [None]
    for draft in drafts:
        tokens = (0, *draft) if draft is not None else draft_tokens(sc, random.Random(0))
        weight = 1.0
        if sc.stochastic:
            for i, par in enumerate(sc.parents[1:], start=1):
                weight *= float(sc.draft(sc.prefix(tokens, par))[tokens[i]])
        if weight == 0.0:
            continue
        for (a, b), pr in _ref_outcomes(sc, tokens, 0, need=2).items():
            joint[a, b] += weight * pr
    return joint


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_exact_output_distribution_is_the_target(name: str) -> None:
    sc = SCENARIOS[name]
    torch.testing.assert_close(exact_joint(sc), target_joint(sc), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------
# Monte Carlo over verify_sampling


def mc_joint(sc: Scenario, n: int, seed: int) -> torch.Tensor:
    """[V, V] counts of the first two emitted tokens over n verify steps."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    continuation = torch.Generator().manual_seed(seed + 1)
    built: dict[tuple[int, ...], tuple[DraftOutput, torch.Tensor]] = {}
    counts = torch.zeros(V, V, dtype=torch.float64)
    fixed = None if sc.stochastic else draft_tokens(sc, rng)
    for _ in range(n):
        tokens = fixed or draft_tokens(sc, rng)
        if tokens not in built:
            built[tokens] = build(sc, tokens)
        out = verify_sampling(*built[tokens], gen).tokens.tolist()
        if len(out) == 1:  # only a recovered token: the next step samples from the target
            out.append(int(sample(sc.target((out[0],)), continuation)))
        counts[out[0], out[1]] += 1
    return counts


N_MC = 8_000


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_monte_carlo_output_distribution_is_the_target(name: str, stats) -> None:
    sc = SCENARIOS[name]
    p_value = stats.chi_square_p_value(mc_joint(sc, N_MC, seed=11), target_joint(sc))
    assert p_value > 1e-3, p_value


MUTANTS = {
    "no-residual": lambda p, q_c: p,
    "unnormalised-residual": lambda p, q_c: (p - q_c).clamp_min(0.0),
}


@pytest.mark.parametrize(
    ("mutant", "name"), [("no-residual", "tree-topk-point"), ("unnormalised-residual", "tree-iid-q")]
)
def test_monte_carlo_detects_a_broken_residual(
    monkeypatch: pytest.MonkeyPatch, mutant: str, name: str, stats
) -> None:
    """Power check: the same test fails when the residual update is wrong.

    (An unnormalised residual only matters for the next sibling's acceptance:
    ``sample`` is scale-invariant, so a chain could not detect it.)
    """
    monkeypatch.setattr(rejection, "_residual", MUTANTS[mutant])
    sc = SCENARIOS[name]
    p_value = stats.chi_square_p_value(mc_joint(sc, 3_000, seed=12), target_joint(sc))
    assert p_value < 1e-6, p_value


# ---------------------------------------------------------------------------
# determinism and hand-built cases


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_same_seed_same_output(name: str) -> None:
    sc = SCENARIOS[name]
    cases = [build(sc, draft_tokens(sc, random.Random(s))) for s in range(20)]

    def run(seed: int) -> list[tuple[list[int], list[int]]]:
        gen = torch.Generator().manual_seed(seed)
        outs = [verify_sampling(d, tp, gen) for d, tp in cases]
        return [(o.path.tolist(), o.tokens.tolist()) for o in outs]

    assert run(5) == run(5)
    assert run(5) != run(6)


def tree_of(tokens: list[int], parents: list[int]) -> Tree:
    return make_tree(torch.tensor(tokens), torch.tensor(parents))


def test_draft_equal_to_target_is_always_accepted() -> None:
    probs = torch.softmax(torch.randn(4, V, generator=torch.Generator().manual_seed(0)), dim=-1)
    draft = DraftOutput(tree_of([0, 1, 2, 3], CHAIN), q=probs.roll(1, dims=0))  # q[i] = p[i - 1]
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        out = verify_sampling(draft, probs, gen)
        assert out.path.tolist() == [0, 1, 2, 3]
        assert out.tokens.tolist()[:3] == [1, 2, 3]


def test_zero_target_probability_token_is_never_emitted() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0], [0.2] * 5])
    draft = DraftOutput(tree_of([0, 3], [-1, 0]))  # point-mass draft of token 3, p = 0
    gen = torch.Generator().manual_seed(0)
    emitted = {tuple(verify_sampling(draft, probs, gen).tokens.tolist()) for _ in range(200)}
    assert emitted == {(1,), (2,)}


def test_root_only_tree_samples_the_bonus_from_the_root_row() -> None:
    probs = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0]])
    out = verify_sampling(DraftOutput(tree_of([4], [-1])), probs, torch.Generator().manual_seed(0))
    assert out.path.tolist() == [0] and out.tokens.tolist() == [2]


def test_greedy_target_reduces_to_greedy_verification() -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(30):
        logits = torch.randn(len(WIDE_TREE), V, generator=gen)
        tokens = [0] + torch.randint(0, V, (len(WIDE_TREE) - 1,), generator=gen).tolist()
        tokens[1:4] = [1, 2, 3]  # distinct root children
        tree = tree_of(tokens, WIDE_TREE)
        probs = logits_to_probs(logits, SamplingParams(temperature=0.0))
        expected = verify_greedy(tree, logits)
        out = verify_sampling(DraftOutput(tree), probs, gen)
        assert out.path.tolist() == expected.path.tolist()
        assert out.tokens.tolist() == expected.tokens.tolist()


def test_input_validation() -> None:
    tree = tree_of([0, 1], [-1, 0])
    gen = torch.Generator().manual_seed(0)
    probs = torch.full((2, V), 1.0 / V)
    with pytest.raises(ValueError):
        verify_sampling(DraftOutput(tree), probs[:1], gen)
    with pytest.raises(ValueError):
        verify_sampling(DraftOutput(tree, q=probs[:, :3]), probs, gen)
    q = probs.clone()
    q[1, 1] = 0.0  # the draft token 1 could not have been drawn from q[1]
    with pytest.raises(ValueError):
        verify_sampling(DraftOutput(tree, q=q), probs, gen)
