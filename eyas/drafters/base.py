"""The drafter interface and registry.

A drafter proposes a token tree rooted at the last sampled token; it never
decides acceptance. The decoder talks to it through three calls:

    start(max_slots)                  a new sequence begins
    extend(tokens, feats)             tokens were committed; feats describe the
                                      target positions right before each of them
    propose(history, sampling, gen)   draft a tree whose root is history[-1]

``extend`` pairs each committed token with the target's features at the
position *preceding* it, which is exactly what EAGLE heads consume: after
prefill of a prompt p[0..T-1] with first sampled token r, ``tokens`` is
p[1..T-1] + [r] and ``feats`` covers positions 0..T-1. After a verify step that
accepted path nodes n0 (root), n1..nA and sampled a final token, ``tokens`` are
the step's new tokens and ``feats`` are the target features at n0..nA.

Drafters that draft in a reduced vocabulary map their proposals to target ids
before returning (``DraftOutput`` is always in target ids).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from eyas.types import DraftOutput, SamplingParams


@dataclass
class TargetFeatures:
    """Target features at M positions (what EAGLE-style heads draft from)."""

    # [M, D] final post-norm feature
    hidden: torch.Tensor
    # layer -> [M, D] residual stream entering that layer (only the drafter's taps)
    taps: dict[int, torch.Tensor] = field(default_factory=dict)


class Drafter(ABC):
    """Proposes draft trees for one sequence at a time."""

    # target layers whose input residual the drafter needs (EAGLE-3 uses three)
    taps: tuple[int, ...] = ()
    # the largest tree (nodes incl. root) propose() can return; sizes the caches
    max_nodes: int = 1

    def start(self, max_slots: int) -> None:  # noqa: B027 (optional hook: stateless drafters keep it)
        """Reset per-sequence state; ``max_slots`` bounds the sequence length."""

    def fork(self) -> Drafter:
        """A drafter for another concurrent sequence: shares weights, own per-sequence state.

        The shallow copy suffices because ``start``/``extend`` rebind their per-sequence
        attributes (caches, histories) instead of mutating shared objects in place; a
        drafter that mutates shared state must override this.
        """
        return copy.copy(self)

    def extend(self, tokens: torch.Tensor, feats: TargetFeatures) -> None:  # noqa: B027 (optional hook)
        """Record committed tokens ([M] long) and the target features before each."""

    @abstractmethod
    def propose(
        self,
        # [n] long, every token so far; history[-1] is the tree root
        history: torch.Tensor,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftOutput:
        """Draft a tree rooted at history[-1]."""


DrafterFactory = Callable[..., Drafter]
_REGISTRY: dict[str, DrafterFactory] = {}


def register_drafter(name: str) -> Callable[[DrafterFactory], DrafterFactory]:
    """Class/function decorator: make a drafter constructible by name."""

    def deco(factory: DrafterFactory) -> DrafterFactory:
        if name in _REGISTRY:
            raise ValueError(f"drafter {name!r} registered twice")
        _REGISTRY[name] = factory
        return factory

    return deco


def drafter_names() -> list[str]:
    return sorted(_REGISTRY)


def get_drafter_factory(name: str) -> DrafterFactory:
    if name not in _REGISTRY:
        raise KeyError(
            f"unknown drafter {name!r}; known drafters: {', '.join(drafter_names())} "
            f"(or a path to a draft head / draft model directory)"
        )
    return _REGISTRY[name]
