"""Lossless sampling verification of chains and trees (rejection sampling).

A chain is the tree whose node i has parent i - 1, so one function serves both.

Algorithm (SpecInfer's multi-step speculative sampling, Miao et al. 2023,
arXiv 2305.09781, Algorithm 2; for a chain it is exactly Leviathan et al. 2023,
arXiv 2211.17192, and Chen et al. 2023, arXiv 2302.01318). At the current node
u, starting at the root, with residual ``p = target_probs[u]``:

1. For each child c of u in node order, with token x and proposal ``q_c``:
   accept c with probability ``min(1, p[x] / q_c[x])``. If accepted, move to c
   (``p = target_probs[c]``) and start again at step 1.
   If rejected, ``p = normalise(max(p - q_c, 0))`` and try the next sibling.
2. When u has no children left to try, sample one token from ``p``: the
   *recovered* token if some child of u was rejected, the *bonus* token if u is
   a leaf.

Preconditions for losslessness:

* ``draft.q is None`` (deterministic drafts: argmax, top-k, n-gram): ``q_c`` is
  the point mass on x, so acceptance is ``p[x]`` and a rejection zeroes ``p[x]``
  and renormalises. Lossless whatever rule chose the tokens; a duplicate
  sibling is simply rejected (its token already has zero residual mass).
* ``draft.q`` given: the children of every node must be drawn i.i.d. (with
  replacement) from one proposal distribution, which is their shared ``q`` row,
  and their subtrees drafted independently given their tokens. Do not
  deduplicate such siblings and do not sample them without replacement: either
  breaks the i.i.d. assumption of the proof. Every draft token must have
  ``q_c[x] > 0`` (checked).
"""

from __future__ import annotations

import torch

from eyas.types import DraftOutput, VerifyOutput
from eyas.verify.sampling import sample


def verify_sampling(
    draft: DraftOutput,
    # [N, V] target distributions after logits_to_probs; row i = next token after node i
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> VerifyOutput:
    """Verify a draft chain or tree so that the output is distributed as the target.

    Args:
        draft: the tree and, optionally, the proposal rows ``q`` [N, V].
        target_probs: [N, V] rows summing to 1 (temperature, top-k and top-p
            already applied by ``logits_to_probs``).
        generator: the only source of randomness, on ``target_probs``' device;
            same seed, same output.

    Returns:
        ``VerifyOutput``: accepted ``path`` [A + 1] and ``tokens`` [A + 1]
        (accepted drafts, then the recovered or bonus token).

    Host syncs: reading the tree structure, the q-support check, and one
    accept/reject branch per tried child (a few per depth level).
    """
    tree = draft.tree
    _check_inputs(draft, target_probs)
    children = _children_lists(tree.parents.tolist())  # host sync: tree structure
    tokens = tree.tokens.tolist()  # host sync
    # NOTE: float64 uniforms, because a float32 torch.rand can return exactly 0
    # (see vLLM's rejection_sampler.py); one per node, consumed in node order.
    uniforms = torch.rand(
        tree.num_nodes, dtype=torch.float64, device=target_probs.device, generator=generator
    )
    path = [0]
    p = target_probs[0].double()
    while True:
        child, p = _try_children(children[path[-1]], tokens, draft.q, p, uniforms)
        if child is None:
            break
        path.append(child)
        p = target_probs[child].double()
    final = sample(p, generator)
    path_t = torch.tensor(path, dtype=torch.long, device=tree.tokens.device)
    out_tokens = torch.cat([tree.tokens[path_t[1:]], final.view(1).to(tree.tokens.dtype)])
    return VerifyOutput(path=path_t, tokens=out_tokens)


def _try_children(
    children: list[int],
    tokens: list[int],
    # [N, V] or None
    q: torch.Tensor | None,
    # [V] float64 residual target distribution at the current node
    p: torch.Tensor,
    # [N] float64 in [0, 1)
    uniforms: torch.Tensor,
) -> tuple[int | None, torch.Tensor]:
    """Try the children of one node in order; return (accepted child or None, p).

    On acceptance ``p`` is returned unchanged (the caller moves to the child);
    when every child is rejected it is the final residual to sample from.
    """
    for c in children:
        x = tokens[c]
        q_c = _proposal(q, c, x, p)
        # accept with probability min(1, p[x] / q[x]); r * q[x] < p[x] avoids a division
        if bool(uniforms[c] * q_c[x] < p[x]):  # host sync: accept/reject branch
            return c, p
        p = _residual(p, q_c)
    return None, p


def _proposal(
    # [N, V] or None
    q: torch.Tensor | None,
    c: int,
    x: int,
    # [V] float64, only read for its shape, dtype and device
    p: torch.Tensor,
) -> torch.Tensor:
    """[V] float64 proposal row of child c: ``q[c]``, or the point mass on its token x."""
    if q is not None:
        return q[c].double()
    q_c = torch.zeros_like(p)
    q_c[x] = 1.0
    return q_c


def _residual(
    # [V] float64
    p: torch.Tensor,
    # [V] float64
    q_c: torch.Tensor,
) -> torch.Tensor:
    """``normalise(max(p - q_c, 0))``: what p has left after a rejected proposal.

    NOTE: the mass is 0 only when p <= q_c everywhere, i.e. p == q_c. Then every
    token in q_c's support is accepted with probability 1 and a rejection has
    probability 0 (it can only come from rounding), so falling back to p costs
    nothing. ``torch.where`` keeps this free of host syncs.
    """
    r = (p - q_c).clamp_min(0.0)
    mass = r.sum()
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(r.dtype).tiny), p)


def _children_lists(parents: list[int]) -> list[list[int]]:
    """Children of each node, in node order."""
    children: list[list[int]] = [[] for _ in parents]
    for i, par in enumerate(parents[1:], start=1):
        children[par].append(i)
    return children


def _check_inputs(draft: DraftOutput, target_probs: torch.Tensor) -> None:
    """Raise ValueError on bad shapes or a draft token outside its proposal's support."""
    tree, q = draft.tree, draft.q
    n = tree.num_nodes
    if target_probs.ndim != 2 or target_probs.shape[0] != n:
        raise ValueError(f"target_probs must be [N={n}, V], got {tuple(target_probs.shape)}")
    if q is None:
        return
    if q.shape != target_probs.shape:
        raise ValueError(f"draft.q must be [N, V] = {tuple(target_probs.shape)}, got {tuple(q.shape)}")
    # [N - 1] proposal probability of each draft token
    q_tok = q[1:].gather(1, tree.tokens[1:, None].long()).squeeze(1)
    if n > 1 and not bool((q_tok > 0).all()):  # host sync: precondition check
        raise ValueError("every draft token must have q > 0 (it must be a draw from q)")
