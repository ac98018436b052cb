r"""Build a ``Tree`` from parents, and read its root-to-leaf paths.

Worked example (5 nodes, root 0)::

        0            tokens  = [t0, t1, t2, t3, t4]
       / \           parents = [-1,  0,  0,  1,  1]
      1   2          depth   = [ 0,  1,  1,  2,  2]
     / \
    3   4            mask (row i = node i and its ancestors):
                         0 1 2 3 4
                     0 [ 1 0 0 0 0 ]
                     1 [ 1 1 0 0 0 ]
                     2 [ 1 0 1 0 0 ]
                     3 [ 1 1 0 1 0 ]
                     4 [ 1 1 0 0 1 ]

    tree_paths -> [[0, 1, 3],      one row per leaf (3, 4, 2), depth-first,
                   [0, 1, 4],      padded with -1 to L = 3
                   [0, 2, -1]]     (EAGLE's "retrieve indices").
"""

from __future__ import annotations

import torch

from eyas.types import Tree


def _check_parents(parents: torch.Tensor) -> None:
    """Raise ValueError unless ``parents`` is a topologically ordered parent array.

    This reads the values on the host (one sync); callers that built the parents
    themselves can skip it with ``make_tree(..., validate=False)``.
    """
    n = parents.shape[0]
    if n == 0:
        raise ValueError("a tree needs at least its root: got 0 nodes")
    if int(parents[0]) != -1:
        raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {int(parents[0])}")
    idx = torch.arange(n, device=parents.device)
    bad = (parents[1:] < 0) | (parents[1:] >= idx[1:])
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0]) + 1
        raise ValueError(
            f"parents must be in topological order (0 <= parents[i] < i for i > 0); "
            f"node {i} has parent {int(parents[i])}. Reorder the nodes so parents come first."
        )


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self mask of a parent array, by pointer jumping.

    Args:
        parents: [N] long, parent of each node, -1 for the root(s).

    Returns:
        [N, N] bool, ``mask[i, j]`` = node j is node i or one of its ancestors.

    After step k, ``mask[i]`` holds the ancestors of i at distance < 2**k and
    ``up[i]`` is the 2**k-th ancestor (``N`` = none, a padding row of zeros), so
    ``ceil(log2 N)`` steps suffice. The step count depends only on N: no host
    sync, no loop over nodes. Works for any parent array without cycles.
    """
    n = parents.shape[0]
    dev = parents.device
    # [N + 1, N] row N is the all-False "no node" row
    mask = torch.zeros(n + 1, n, dtype=torch.bool, device=dev)
    mask[torch.arange(n, device=dev), torch.arange(n, device=dev)] = True
    # [N + 1] 2**k-th ancestor of each node, N for none
    up = torch.where(parents >= 0, parents, torch.full_like(parents, n))
    up = torch.cat([up, up.new_full((1,), n)])
    reach = 1
    while reach < n:
        mask = mask | mask[up]
        up = up[up]
        reach *= 2
    return mask[:n]


def make_tree(tokens: torch.Tensor, parents: torch.Tensor, validate: bool = True) -> Tree:
    """Build a ``Tree`` (depth and mask) from tokens and parents.

    Args:
        tokens: [N] long, token of each node, node 0 = root.
        parents: [N] long, parent of each node; ``parents[0] == -1`` and
            ``0 <= parents[i] < i`` otherwise.
        validate: check the topological order (one host sync). Pass False
            only for parents you constructed correctly yourself.

    Raises:
        ValueError: on mismatched shapes or a parent array out of order.
    """
    if tokens.ndim != 1 or parents.ndim != 1 or tokens.shape != parents.shape:
        raise ValueError(
            f"tokens and parents must both be [N]; got {tuple(tokens.shape)} and {tuple(parents.shape)}"
        )
    parents = parents.long()
    if validate:
        _check_parents(parents)
    mask = ancestor_mask(parents)
    depth = mask.sum(dim=1) - 1
    return Tree(tokens=tokens, parents=parents, depth=depth, mask=mask)


def tree_from_lists(tokens: list[int], parents: list[int], device: torch.device | str | None = None) -> Tree:
    """``make_tree`` for a small tree built on the host: parents already topological (``parents[i] < i``).

    Depth and the ancestor mask come from one pass over the lists (bit masks), then four tensors: for the
    tens of nodes of a draft tree that is several times cheaper than the tensor ops of ``ancestor_mask``.
    """
    n = len(tokens)
    anc, depth = [0] * n, [0] * n
    for i, p in enumerate(parents):
        anc[i] = (anc[p] if p >= 0 else 0) | (1 << i)
        depth[i] = depth[p] + 1 if p >= 0 else 0
    return Tree(
        tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        parents=torch.tensor(parents, dtype=torch.long, device=device),
        depth=torch.tensor(depth, dtype=torch.long, device=device),
        mask=bit_mask(anc, range(n), device),
    )


def bit_mask(rows: list[int], cols, device: torch.device | str | None = None) -> torch.Tensor:
    """[len(rows), len(cols)] bool: entry (r, c) = bit ``cols[c]`` of the bit set ``rows[r]``."""
    return torch.tensor([[(bits >> c) & 1 == 1 for c in cols] for bits in rows], dtype=torch.bool,
                        device=device).reshape(len(rows), len(cols))


def chain_tree(tokens: torch.Tensor) -> Tree:
    """The chain tree: root then K drafts, node i's parent is i - 1.

    Args:
        tokens: [K + 1] long, the root followed by K draft tokens.
    """
    if tokens.ndim != 1 or tokens.shape[0] == 0:
        raise ValueError(f"tokens must be [K + 1] with K >= 0, got shape {tuple(tokens.shape)}")
    n = tokens.shape[0]
    idx = torch.arange(n, device=tokens.device)
    mask = idx[None, :] <= idx[:, None]
    return Tree(tokens=tokens, parents=idx - 1, depth=idx, mask=mask)


def tree_paths(tree: Tree) -> torch.Tensor:
    """Root-to-leaf paths of a tree (EAGLE's ``retrieve_indices``).

    Returns:
        [P, L] long, one row per leaf (node without children): the node
        indices from the root (column 0 is always 0) to the leaf, padded with
        -1. L = max depth + 1. Rows are in depth-first order (lexicographic,
        -1 after every index), the order EAGLE sorts its retrieve indices in.

    Reads the maximum depth and the leaf count on the host (the output shape
    depends on them); call once per static tree, not in a hot loop.
    """
    n = tree.num_nodes
    dev = tree.parents.device
    has_child = torch.zeros(n, dtype=torch.bool, device=dev)
    has_child[tree.parents[1:]] = True
    leaves = (~has_child).nonzero().squeeze(1)
    length = int(tree.depth.max()) + 1
    paths = torch.full((leaves.shape[0], length), -1, dtype=torch.long, device=dev)
    # an ancestor j of leaf p sits at column depth[j] of row p
    rows, cols = tree.mask[leaves].nonzero(as_tuple=True)
    paths[rows, tree.depth[cols]] = cols
    # lexicographic row order: stable sorts from the last column to the first
    key = torch.where(paths >= 0, paths, n)
    order = torch.arange(paths.shape[0], device=dev)
    for col in reversed(range(length)):
        order = order[torch.sort(key[order, col], stable=True).indices]
    return paths[order]
