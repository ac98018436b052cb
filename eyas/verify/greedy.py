"""Greedy (temperature 0) verification of a token tree.

Lossless in the strongest sense: the emitted tokens are exactly what greedy
decoding with the target would produce, token for token (up to argmax ties and
the numerics of the tree forward).
"""

from __future__ import annotations

import torch

from eyas.types import Tree, VerifyOutput
from eyas.verify.paths import check_rows


def verify_greedy(
    tree: Tree,
    # [N, V] target logits; row i is the distribution of the token after node i
    logits: torch.Tensor,
    # [N] long, logits.argmax(-1) where the caller has a faster way to it (eyas.kernels.argmax); None: torch's
    greedy: torch.Tensor | None = None,
) -> VerifyOutput:
    """Accept the longest root path whose tokens all equal the target's argmax.

    A node matches when its token equals the argmax at its parent; a node is
    accepted when it and all its ancestors match. Among accepted nodes the
    deepest wins (lowest node index on ties). With distinct siblings at most one
    child matches, so this is the usual walk from the root. With duplicate
    siblings every copy matches and the deepest accepted subtree wins, which is
    at least as long as taking the first copy; the emitted tokens are the same
    greedy continuation either way.

    The emitted tokens are the accepted drafts followed by the argmax at the
    last accepted node (the bonus token when that node is a leaf, otherwise the
    token that replaces the mismatched children; both are the target's greedy
    choice).

    Returns:
        ``VerifyOutput`` with ``path`` [A + 1] and ``tokens`` [A + 1].
    """
    check_rows(tree, logits, "logits")
    # [N] greedy token after each node
    target = logits.argmax(dim=-1) if greedy is None else greedy
    # one host transfer, then a walk over the N nodes in Python: a draft tree has a handful of nodes, and each
    # torch op on a tensor of four elements costs more (microseconds of dispatch, cold right after the target
    # forward) than the whole walk; the rule is ``deepest_passing_path``'s
    toks, parents, choice = torch.stack([tree.tokens, tree.parents, target]).tolist()
    path = deepest_accepted(toks, parents, choice)
    emitted = [toks[i] for i in path[1:]] + [choice[path[-1]]]
    dev = logits.device
    return VerifyOutput(path=torch.tensor(path, device=dev), tokens=torch.tensor(emitted, device=dev))


def deepest_accepted(tokens: list[int], parents: list[int], greedy: list[int]) -> list[int]:
    """Node indices from the root to the deepest node whose path matches the target's greedy tokens
    (``greedy[i]``: the target's choice after node i); ties go to the lowest node index.

    Example: tokens [9, 1, 2, 3, 5], parents [-1, 0, 0, 1, 2], greedy [2, 3, 5, 0, 6] -> [0, 2, 4].
    """
    depth = [0] * len(tokens)  # depth of an accepted node, -1 for a rejected one
    best = 0
    for i in range(1, len(tokens)):
        p = parents[i]
        depth[i] = depth[p] + 1 if depth[p] >= 0 and tokens[i] == greedy[p] else -1
        if depth[i] > depth[best]:
            best = i
    path = [best]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    return path[::-1]

