"""Model-free token trees: build, static templates, EAGLE-2 dynamic trees."""

from eyas.tree.build import ancestor_mask, chain_tree, make_tree, tree_paths
from eyas.tree.dynamic import DynamicTree, DynamicTreeBuilder, DynamicTreeConfig, Frontier
from eyas.tree.presets import PRESETS
from eyas.tree.static import StaticTree, parse_choices, static_tree, validate_choices

__all__ = [
    "PRESETS",
    "DynamicTree",
    "DynamicTreeBuilder",
    "DynamicTreeConfig",
    "Frontier",
    "StaticTree",
    "ancestor_mask",
    "chain_tree",
    "make_tree",
    "parse_choices",
    "static_tree",
    "tree_paths",
    "validate_choices",
]
