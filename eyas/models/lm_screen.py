"""Greedy decoding's output projection, screened: only the logits that can be the argmax are computed exactly.

A greedy step needs the argmax of each row's logits, not all 49,152 of them. ``eyas/kernels/lm_screen.cpp`` runs
the output projection once in integers (the GGUF file's Q8_0 weights against the row rounded to int8 per 32
values, AVX512-VNNI), with a bound on how far each approximate logit can be from the bf16 block kernel's; every
entry whose interval reaches the row's best lower bound is a candidate (a handful on SmolLM2), and only those are
computed exactly, by the same block kernel on their gathered weight rows (its outputs do not depend on which rows
share a call). Every other entry is ``-inf``, so ``argmax`` returns the index the full projection gives, first
maximum and ties included; nothing else may be read from such logits.

Where it serves (``screened_logits``): exact mode's bf16 decode, verification and last-prompt-token forwards of a
target whose output projection is Q8_0 blocks, when the caller asked for the argmax only (``ForwardMeta.
argmax_only``: greedy, no typical acceptance). On the Intel Xeon VM the projection costs 0.7 against 1.6 ms at
one row and 1.0 against 2.8 ms at four (docs/benchmarks.md). ``EYAS_LM_SCREEN=0`` turns it off.
"""

from __future__ import annotations

import torch
from torch import nn

from eyas import kernels

Q8_0 = 8
_kernel = kernels.Lazy(kernels.lm_screen, usable=lambda k: k.available())


class ArgmaxScreen:
    """One output projection's blocks in the screen's layout (~35 MB for SmolLM2's [49152, 576])."""

    def __init__(self, blocks) -> None:
        kernel = _kernel()
        self.blocks = blocks  # eyas.models.gguf_blocks.GGUFBlocks
        self.vocab = blocks.data.shape[0]
        self.packed = kernel.pack(blocks.data, blocks.k)
        self.max_rows = kernel.max_rows()

    def logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [R, K] bf16 -> [R, V] float32: the exact bf16 logit at every row's candidates, ``-inf`` elsewhere;
        None where an approximation is not finite (the caller computes every logit).
        """
        from eyas.models.gguf_blocks import GGUFBlocks

        parts = [_kernel().candidates(part, self.packed, self.vocab) for part in x.split(self.max_rows)]
        if any(p.numel() == 0 for p in parts):
            return None
        cand = parts[0] if len(parts) == 1 else torch.cat(parts).unique()
        sub = GGUFBlocks(data=self.blocks.data.index_select(0, cand), qtype=self.blocks.qtype, k=self.blocks.k)
        out = torch.full((x.shape[0], self.vocab), float("-inf"))
        out[:, cand] = sub.linear(x, None).float()
        return out


def screened_logits(proj: nn.Module, rows: torch.Tensor) -> torch.Tensor | None:
    """rows [B, T, K] -> [B, T, V] argmax-only logits through ``proj``'s screen, or None where it does not serve
    (no Q8_0 blocks, not bf16, a bias, no kernel, a non-finite row): the caller then computes every logit.
    """
    screen = proj.__dict__.get("_eyas_screen", False)
    if screen is False:  # built on first use: the packed copy costs memory only where greedy decoding runs
        screen = proj.__dict__["_eyas_screen"] = _build(proj)
    if screen is None or rows.dtype != torch.bfloat16 or rows.requires_grad or rows.is_cuda:
        return None
    b, t, k = rows.shape
    out = screen.logits(rows.reshape(b * t, k))
    return None if out is None else out.view(b, t, -1)


def _build(proj: nn.Module) -> ArgmaxScreen | None:
    blocks = proj.__dict__.get("_eyas_blocks")
    if blocks is None or blocks.qtype != Q8_0 or getattr(proj, "bias", None) is not None or _kernel() is None:
        return None
    return ArgmaxScreen(blocks)
