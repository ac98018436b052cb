"""Helpers shared by the deterministic verifiers (greedy, typical).

Both decide, for every node independently, whether its token passes a test
against the target's output at its parent; a node is then on an accepted path
iff it and all its ancestors pass. The tree's ancestor mask turns that into one
vectorised ``all``, with no Python loop over nodes.
"""

from __future__ import annotations

import torch

from eyas.types import Tree


def check_rows(
    tree: Tree,
    # [N, V]
    rows: torch.Tensor,
    name: str,
) -> None:
    """Raise ValueError unless ``rows`` is [N, V] for the tree's N nodes."""
    if rows.ndim != 2 or rows.shape[0] != tree.num_nodes:
        raise ValueError(f"{name} must be [N={tree.num_nodes}, V], got {tuple(rows.shape)}")


def deepest_passing_path(
    tree: Tree,
    # [N] bool, node i's own token passed its test (entry 0, the root, is ignored)
    passed: torch.Tensor,
) -> torch.Tensor:
    """The longest root path whose nodes all passed; ties go to the lowest leaf index.

    Returns:
        [A + 1] long node indices from the root (0) to the last accepted node.

    Worked example (tokens/parents as in ``eyas.tree.build``'s docstring)::

        parents = [-1, 0, 0, 1, 1], passed = [*, F, T, T, T]
        on_path = [T, F, T, F, F]   (3 and 4 pass but their parent 1 does not)
        deepest = node 2 (depth 1) -> path [0, 2]
    """
    is_root = torch.arange(tree.num_nodes, device=passed.device) == 0
    passed = passed | is_root
    # [N] on_path[i] = every ancestor-or-self j of i passed
    on_path = (~tree.mask | passed[None, :]).all(dim=-1)
    score = torch.where(on_path, tree.depth, torch.full_like(tree.depth, -1))
    last = score.argmax()  # first maximal index: lowest node index among the deepest
    # host sync: the path length is data-dependent. Nodes are in topological
    # order, so ancestors sorted by index are sorted by depth.
    return tree.mask[last].nonzero().squeeze(-1)
