"""Named static-tree choice lists (EAGLE-1 / Medusa format).

Each choice is a path of top-k ranks from the root: ``[0, 1]`` is the
second-ranked child of the top-ranked child of the root. The root itself is
implicit, so a list of C choices gives a tree of C + 1 nodes.
"""

from __future__ import annotations

# Source: SafeAILab/EAGLE, eagle/model/choices.py (``mc_sim_7b_63``), EAGLE-1's
# default tree. Despite the name it has 25 choices (26 nodes with the root).
EAGLE_MC_SIM_7B_63: list[list[int]] = [
    [0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
]  # fmt: skip

# Source: FasterDecoding/Medusa, medusa/model/medusa_choices.py (``mc_sim_7b_63``):
# 63 choices (64 nodes with the root), listed in Medusa's order.
MEDUSA_MC_SIM_7B_63: list[list[int]] = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4],
    [2, 0], [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8],
    [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0],
    [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0],
    [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2],
    [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0],
    [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0],
]  # fmt: skip


# Defined by eyas (not from a paper): 19 choices, 20 nodes; a narrow tree, deep
# along the greedy path, small enough for a CPU.
EAGLE_SMALL: list[list[int]] = [
    [0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0],
    [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1],
    [0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0],
]  # fmt: skip


def _chain(k: int) -> list[list[int]]:
    return [[0] * d for d in range(1, k + 1)]


def _full(width: int, depth: int) -> list[list[int]]:
    """Every path of ranks < width up to the given depth."""
    level: list[list[int]] = [[]]
    out: list[list[int]] = []
    for _ in range(depth):
        level = [p + [r] for p in level for r in range(width)]
        out += level
    return out


# chain*, binary_* and eagle_small are defined by eyas (not from a paper): small
# trees for tests and CPU runs.
PRESETS: dict[str, list[list[int]]] = {
    "mc_sim_7b_63": EAGLE_MC_SIM_7B_63,  # EAGLE's default, as in EAGLE's code
    "eagle_mc_sim_7b_63": EAGLE_MC_SIM_7B_63,
    "medusa_mc_sim_7b_63": MEDUSA_MC_SIM_7B_63,
    "chain4": _chain(4),  # 5 nodes
    "chain6": _chain(6),  # 7 nodes
    "binary_2x3": _full(2, 3),  # full binary tree of depth 3: 15 nodes
    "eagle_small": EAGLE_SMALL,
}
