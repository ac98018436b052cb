"""A small causal LM sharing the target's tokenizer drafts a chain of K tokens
(Leviathan et al. 2023; gpt-fast ``speculative_decode``).

The draft model keeps its own KV cache. Each propose() feeds only the tokens
the draft cache has not seen (the longest common prefix of what it was fed and
the real history is reused), then decodes K tokens one by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.drafters.base import Drafter, register_drafter
from eyas.models.base import TargetModel
from eyas.tree import chain_tree
from eyas.types import DraftOutput, SamplingParams
from eyas.verify import logits_to_probs, sample


@dataclass
class DraftLMConfig:
    num_draft: int = 4  # K, tokens drafted per step

    def __post_init__(self) -> None:
        if self.num_draft < 1:
            raise ValueError(f"num_draft must be >= 1, got {self.num_draft}")


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    m = min(a.shape[0], b.shape[0])
    diff = (a[:m] != b[:m]).nonzero()
    return int(diff[0]) if diff.numel() else m


@register_drafter("draft")
class DraftLMDrafter(Drafter):
    """Chain drafting with a small LM (greedy: argmax; sampling: draws from its q)."""

    def __init__(self, target=None, path: Path | None = None, model: TargetModel | None = None,
                 tree: str | None = None, cfg: DraftLMConfig | None = None, **options) -> None:
        if tree not in (None, "chain"):
            raise ValueError(f"a draft LM drafts a chain; --tree {tree} does not apply")
        if model is None:
            if path is None:
                raise ValueError("the draft drafter needs a model directory: --drafter PATH")
            from eyas.models.loading import native_from_dir

            model = native_from_dir(Path(path), target.model.dtype)
        self.model = model
        self.cfg = cfg or DraftLMConfig(**options)
        self.vocab = target.model.config.vocab_size if target is not None else model.config.vocab_size
        if model.config.vocab_size > self.vocab:
            raise ValueError(
                f"draft model vocab ({model.config.vocab_size}) is larger than the target's ({self.vocab}); "
                "the draft model must share the target's tokenizer"
            )
        self.max_nodes = 1 + self.cfg.num_draft

    def start(self, max_slots: int) -> None:
        self.cache = self.model.new_cache(1, max_slots + self.cfg.num_draft + 1)
        self.fed = torch.empty(0, dtype=torch.long, device=self.model.device)

    def _feed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Feed tokens [T] at slots start..; return logits [V] after the last one."""
        dev = tokens.device
        # target ids beyond a smaller (unpadded) draft vocabulary become poorer guesses, never errors
        tokens = tokens.clamp(max=self.model.config.vocab_size - 1)
        pos = torch.arange(start, start + tokens.shape[0], device=dev)
        out = self.model.forward(tokens[None], pos[None], self.cache, start, None,
                                 logits_idx=torch.tensor([tokens.shape[0] - 1], device=dev))
        return out.logits[0, -1]

    def _pick(self, logits: torch.Tensor, sampling: SamplingParams, gen) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [Vd] -> token [1] and its proposal distribution [V] (None when greedy)."""
        if sampling.greedy:
            return logits.argmax(-1, keepdim=True), None
        q = logits_to_probs(logits, sampling)
        q = torch.nn.functional.pad(q, (0, self.vocab - q.shape[-1]))
        return sample(q, gen).reshape(1), q

    def propose(self, history: torch.Tensor, sampling: SamplingParams, generator=None) -> DraftOutput:
        common = min(_common_prefix(self.fed, history), history.shape[0] - 1)
        logits = self._feed(history[common:], common)
        drafts, qs = [], []
        pos = history.shape[0]
        for i in range(self.cfg.num_draft):
            tok, q = self._pick(logits, sampling, generator)
            drafts.append(tok)
            qs.append(q)
            if i + 1 < self.cfg.num_draft:
                logits = self._feed(tok, pos + i)
        self.fed = torch.cat([history, *drafts[:-1]])
        tree = chain_tree(torch.cat([history[-1:], *drafts]))
        q = None if qs[0] is None else torch.stack([torch.zeros_like(qs[0]), *qs])
        return DraftOutput(tree=tree, q=q)
