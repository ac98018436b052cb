"""Static trees from a choices list (EAGLE-1 / Medusa format).

A *choice* is a path of top-k ranks from the root: ``[1, 0]`` is the top-ranked
child of the second-ranked child of the root. Nodes are ordered by depth, then
lexicographically by choice, as EAGLE's and Medusa's ``generate_tree_buffers``
sort them (``sorted(choices, key=lambda c: (len(c), c))``); node 0 is the root.

Worked example, ``choices = [[0], [1], [0, 0], [0, 1], [1, 0]]``::

    node    0     1    2    3       4       5
    choice  root  [0]  [1]  [0, 0]  [0, 1]  [1, 0]
    parent  -1    0    0    1       1       2
    rank    -1    0    1    0       1       0
    depth   0     1    1    2       2       2

    children      = [[1, 2], [3, 4], [5, -1], [-1, -1], ...]   (padded with -1)
    child_ranks   = [[0, 1], [0, 1], [0, -1], [-1, -1], ...]
    topk_per_depth = [2, 2]   (depth 1 needs ranks 0..1, depth 2 needs 0..1)
    paths         = [[0, 1, 3], [0, 1, 4], [0, 2, 5]]

A rank may be present without its lower-ranked siblings (``[[0], [2]]``);
EAGLE accepts such trees too, and they keep the same ordering.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

import torch

from eyas.tree.build import ancestor_mask, tree_paths
from eyas.tree.presets import PRESETS
from eyas.types import Tree

_FORMAT = "a list of paths of top-k ranks from the root, e.g. [[0], [1], [0, 0]]"


@dataclass
class StaticTree:
    """A token-free tree template; ``with_tokens`` fills it in each step."""

    # the validated choices, in node order (node i + 1 = choices[i])
    choices: list[list[int]]
    # [N] long, parent node of each node, -1 for the root
    parents: torch.Tensor
    # [N] long, rank of each node among its parent's top-k candidates, -1 for the root
    ranks: torch.Tensor
    # [N] long, depth of each node (root = 0)
    depth: torch.Tensor
    # [N, N] bool, mask[i, j] = node j is node i or one of its ancestors
    mask: torch.Tensor
    # [P, L] long, root-to-leaf node indices padded with -1 (EAGLE's retrieve indices)
    paths: torch.Tensor
    # [N, C] long, children of each node in rank order, padded with -1 (C = most children)
    children: torch.Tensor
    # [N, C] long, rank of each child in ``children``, padded with -1
    child_ranks: torch.Tensor
    # topk_per_depth[d - 1] = top-k width a drafter needs at depth d (max rank + 1)
    topk_per_depth: list[int]

    @property
    def num_nodes(self) -> int:
        return int(self.parents.shape[0])

    def to(self, device: torch.device | str) -> StaticTree:
        """A copy with every tensor on ``device`` (do this once, not per step)."""
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return StaticTree(**moved)

    def with_tokens(self, tokens: torch.Tensor) -> Tree:
        """The ``Tree`` of this template holding ``tokens``; nothing is recomputed.

        Args:
            tokens: [N] long, token of each node in node order (node 0 = root).
        """
        if tokens.shape != (self.num_nodes,):
            raise ValueError(
                f"tokens must be [N] = [{self.num_nodes}] for this tree, got {tuple(tokens.shape)}"
            )
        dev = tokens.device
        return Tree(
            tokens=tokens,
            parents=self.parents.to(dev),
            depth=self.depth.to(dev),
            mask=self.mask.to(dev),
        )


def validate_choices(choices: object) -> list[list[int]]:
    """Check a choices list and return it as sorted lists of ints (node order).

    Raises:
        ValueError: naming the first problem found and how to fix it.
    """
    if not isinstance(choices, (list, tuple)):
        raise ValueError(f"tree choices must be {_FORMAT}; got {type(choices).__name__}")
    if len(choices) == 0:
        raise ValueError(f"tree choices are empty; pass {_FORMAT}")
    seen: set[tuple[int, ...]] = set()
    for c in choices:
        ok = isinstance(c, (list, tuple)) and len(c) > 0
        ok = ok and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in c)
        if not ok:
            raise ValueError(
                f"tree choice {c!r} is not a non-empty list of non-negative int ranks; "
                f"each choice must look like [0] or [0, 1]"
            )
        if tuple(c) in seen:
            raise ValueError(f"tree choice {list(c)} appears twice; remove the duplicate")
        seen.add(tuple(c))
    for c in choices:
        if len(c) > 1 and tuple(c[:-1]) not in seen:
            raise ValueError(
                f"tree choice {list(c)} has no parent: its prefix {list(c[:-1])} is missing; "
                f"add {list(c[:-1])} (every prefix of a choice must be a choice too)"
            )
    return sorted((list(c) for c in choices), key=lambda c: (len(c), c))


def static_tree(choices: object) -> StaticTree:
    """Build the static tree template of a choices list (validated first).

    Args:
        choices: list of top-k rank paths, e.g. ``[[0], [1], [0, 0]]``; any order.

    Raises:
        ValueError: if the list is malformed (see ``validate_choices``).
    """
    ordered = validate_choices(choices)
    node_of = {(): 0}
    node_of.update({tuple(c): i + 1 for i, c in enumerate(ordered)})
    parents = torch.tensor([-1] + [node_of[tuple(c[:-1])] for c in ordered], dtype=torch.long)
    ranks = torch.tensor([-1] + [c[-1] for c in ordered], dtype=torch.long)
    depth = torch.tensor([0] + [len(c) for c in ordered], dtype=torch.long)
    mask = ancestor_mask(parents)
    tokens = torch.zeros_like(parents)
    paths = tree_paths(Tree(tokens=tokens, parents=parents, depth=depth, mask=mask))
    children, child_ranks = _children(parents, ranks)
    max_depth = len(ordered[-1])
    topk_per_depth = [int(ranks[depth == d].max()) + 1 for d in range(1, max_depth + 1)]
    return StaticTree(
        choices=ordered,
        parents=parents,
        ranks=ranks,
        depth=depth,
        mask=mask,
        paths=paths,
        children=children,
        child_ranks=child_ranks,
        topk_per_depth=topk_per_depth,
    )


def _children(parents: torch.Tensor, ranks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, C] children (node order = rank order within a parent) and their ranks."""
    n = parents.shape[0]
    counts = torch.bincount(parents[1:], minlength=n)
    width = max(int(counts.max()), 1)
    # siblings are contiguous (same length, same prefix), so a child's slot is its
    # offset from its parent's first child
    idx = torch.arange(1, n)
    first = torch.full((n,), n, dtype=torch.long).scatter_reduce(0, parents[1:], idx, "amin")
    children = torch.full((n, width), -1, dtype=torch.long)
    children[parents[1:], idx - first[parents[1:]]] = idx
    child_ranks = torch.where(children >= 0, ranks[children.clamp(min=0)], -1)
    return children, child_ranks


def parse_choices(text: str) -> list[list[int]]:
    """Parse a CLI tree spec: a preset name or a literal choices list.

    Accepts ``"mc_sim_7b_63"``, ``"[[0], [1], [0, 0]]"`` (Python or JSON
    literal, read with ``ast.literal_eval``, never ``eval``), each optionally
    prefixed with ``"static:"``. Returns the validated choices in node order.

    Raises:
        ValueError: for an unknown name, an unreadable literal or bad choices.
    """
    if not isinstance(text, str):
        raise ValueError(f"tree spec must be a string, got {type(text).__name__}")
    spec = text.strip()
    spec = spec[len("static:") :].strip() if spec.startswith("static:") else spec
    if spec in PRESETS:
        return validate_choices([list(c) for c in PRESETS[spec]])
    if not spec.startswith("["):
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown tree preset {spec!r}; known presets: {known}; or pass {_FORMAT}")
    try:
        value = ast.literal_eval(spec)
    except (ValueError, SyntaxError, MemoryError, RecursionError) as e:
        raise ValueError(f"could not read tree choices {spec!r} ({e}); pass {_FORMAT}") from None
    return validate_choices(value)
