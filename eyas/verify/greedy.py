"""Greedy (temperature 0) verification of a token tree.

Lossless in the strongest sense: the emitted tokens are exactly what greedy
decoding with the target would produce, token for token (up to argmax ties and
the numerics of the tree forward).
"""

from __future__ import annotations

import torch

from eyas.types import Tree, VerifyOutput
from eyas.verify.paths import check_rows, deepest_passing_path


def verify_greedy(
    tree: Tree,
    # [N, V] target logits; row i is the distribution of the token after node i
    logits: torch.Tensor,
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
    target = logits.argmax(dim=-1)
    # [N] node i's token is the target's choice after its parent (root: ignored)
    matches = tree.tokens == target[tree.parents.clamp_min(0)]
    path = deepest_passing_path(tree, matches)
    tokens = torch.cat([tree.tokens[path[1:]], target[path[-1:]]])
    return VerifyOutput(path=path, tokens=tokens)
