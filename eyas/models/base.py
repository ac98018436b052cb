"""The target-model contract every backend (native, transformers) implements.

A target runs a forward over T new tokens with explicit positions and an
explicit attention mask on top of a cached prefix, writing their keys/values at
cache slots ``start .. start + T``, and can commit an accepted tree path into
place. Models know nothing about speculation beyond that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from eyas.models.config import ModelConfig


@dataclass
class ForwardOutput:
    # [B, T, V] (or [B, len(logits_idx), V] when only some rows were asked for)
    logits: torch.Tensor
    # [B, T, D] final feature after the last norm (what EAGLE-1 drafts from)
    hidden: torch.Tensor
    # layer index -> [B, T, D] residual stream entering that layer (EAGLE-3 taps)
    taps: dict[int, torch.Tensor] = field(default_factory=dict)


class TargetModel(ABC):
    """A causal LM that eyas can speculate on."""

    config: ModelConfig
    # forward() takes ``start`` as a [B] long tensor too (one committed length per row), so
    # sequences of different lengths share one batched forward (eyas.batch)
    row_starts: bool = False

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype: ...

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @abstractmethod
    def new_cache(self, batch: int, max_slots: int):
        """Allocate a cache holding ``max_slots`` positions for ``batch`` rows."""

    @abstractmethod
    def forward(
        self,
        # [B, T] long
        tokens: torch.Tensor,
        # [B, T] long, absolute positions (RoPE)
        positions: torch.Tensor,
        cache,
        # cached slots before the new tokens: an int, or [B] long when ``row_starts``
        start: int | torch.Tensor,
        # [B, T, S] bool, True = may attend; S = kv_len or start + T; None = causal
        mask: torch.Tensor | None = None,
        taps: tuple[int, ...] = (),
        # [R] long rows of T to compute logits for; None = all
        logits_idx: torch.Tensor | None = None,
        kv_len: int | None = None,
    ) -> ForwardOutput:
        """Run T new tokens after ``start`` cached slots."""

    @abstractmethod
    def commit(self, cache, start: int, src: torch.Tensor) -> None:
        """Move accepted entries ``start + src[j]`` to ``start + j``; src: [A] long."""

    @abstractmethod
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] long -> [B, T, D] input embeddings."""

    @abstractmethod
    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., D] final features -> [..., V] logits."""


def causal_mask(t: int, start: int, kv_len: int | None = None, device=None) -> torch.Tensor:
    """[T, S] bool mask for a chain of T tokens after ``start`` cached slots.

    Row i may attend slots 0 .. start + i. S = kv_len (>= start + T) or start + T.
    """
    s = kv_len if kv_len is not None else start + t
    rows = torch.arange(t, device=device)[:, None] + start
    return torch.arange(s, device=device)[None, :] <= rows
