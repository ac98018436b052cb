"""Greedy decoding's output projection, screened: only the logits that can be the argmax are computed exactly.

A greedy step needs the argmax of each row's logits, not all 49,152 of them. ``eyas/kernels/lm_screen.cpp`` runs
the output projection once in integers (the GGUF file's Q8_0 weights against the row rounded to int8 per 32
values, AVX512-VNNI), with a bound on how far each approximate logit can be from the bf16 block kernel's; every
entry whose interval reaches the row's best lower bound is a candidate (a handful on SmolLM2), and only those are
computed exactly, by the same block kernel on their gathered weight rows (its outputs do not depend on which rows
share a call). Every other entry is ``-inf``, so ``argmax`` returns the index the full projection gives, first
maximum and ties included; nothing else may be read from such logits. The block kernel's module does that last step
in one call (``at_candidates``: the gather, the exact logits, the ``-inf`` rows and each row's argmax, ``Screened.
greedy``, which verification reads instead of scanning the 49,152 logits again).

Where it serves (``screened``): exact mode's bf16 decode, verification and last-prompt-token forwards of a
target whose output projection is Q8_0 blocks, when the caller asked for the argmax only (``ForwardMeta.
argmax_only``: greedy, no typical acceptance). On the Intel Xeon VM the projection costs 0.8 against 1.65 ms at
one row and 1.1 against 2.8 ms at four (docs/benchmarks.md). Whether it pays is timed once per machine and output
projection at the first greedy forward (~0.5 s, then read from ``$EYAS_CACHE/lm_screen/``): it serves where it takes
at most ``PAYS`` of the full projection's time. ``EYAS_LM_SCREEN=0`` turns it off, ``=1`` on without the timing.

The integer pass streams ~35 MB of weights a forward; each line of the group ``EYAS_LM_SCREEN_PREFETCH`` groups ahead
(default 2; 0 off) is prefetched non-temporally beside the line read. Zen 5 VM, one process, the same head both arms
(``scripts/head_ab.py --later-env EYAS_LM_SCREEN_PREFETCH=0``): docs/benchmarks.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from eyas import kernels
from eyas.models.gguf_blocks import GGUFBlocks, attached_blocks, block_kernel
from eyas.models.machine_cache import best_alternating, cached_json, machine_key
from eyas.notes import one_time_note

Q8_0 = 8
# the screen serves where it costs at most this share of the full projection (timing noise aside, any saving is one:
# the argmax is the same either way)
PAYS = 0.95
TIMED_ROWS = (1, 3)  # a plain step's row, and a typical verify tree's
_kernel = kernels.Lazy(kernels.lm_screen, usable=lambda k: k.available())


class ArgmaxScreen:
    """One output projection's blocks in the screen's layout (~35 MB for SmolLM2's [49152, 576])."""

    def __init__(self, blocks: GGUFBlocks) -> None:
        kernel = _kernel()
        self.blocks = blocks
        self.vocab = blocks.data.shape[0]
        self.packed = kernel.pack(blocks.data, blocks.k)
        self.max_rows = kernel.max_rows()
        self.prefetch = prefetch_from_env()

    def logits(self, x: torch.Tensor) -> Screened | None:
        """x [R, K] bf16 -> the rows' screened logits ([R, V] float32: the exact bf16 logit at every row's
        candidates, ``-inf`` elsewhere) and argmax ([R] long); None where an approximation is not finite (the caller
        computes every logit).
        """
        parts = [_kernel().candidates(part, self.packed, self.vocab, self.prefetch) for part in x.split(self.max_rows)]
        if any(p.numel() == 0 for p in parts):
            return None
        cand = parts[0] if len(parts) == 1 else torch.cat(parts).unique()  # ascending either way
        logits, greedy = block_kernel().at_candidates(x.contiguous(), self.blocks.data, self.blocks.qtype, cand,
                                                      self.vocab)
        return Screened(logits, greedy)


@dataclass
class Screened:
    """A greedy forward's output projection through the screen."""

    logits: torch.Tensor  # [..., V] float32: exact at every row's candidates, -inf elsewhere (read only its argmax)
    greedy: torch.Tensor  # [...] long: each row's argmax, first maximum (argmax over ``logits`` gives the same)


def prefetch_from_env() -> int:
    """``EYAS_LM_SCREEN_PREFETCH`` checked: weight groups the screen prefetches ahead, 0 (off) to 64; default 2."""
    return kernels.prefetch_env("EYAS_LM_SCREEN_PREFETCH", 2, "weight groups the output screen prefetches ahead")


def screened(proj: nn.Module, rows: torch.Tensor) -> Screened | None:
    """rows [B, T, K] -> argmax-only logits [B, T, V] and the argmax [B, T] through ``proj``'s screen, or None where
    it does not serve (no Q8_0 blocks, not bf16, a bias, no kernel, a non-finite row): the caller then computes every
    logit.
    """
    screen = proj.__dict__.get("_eyas_screen", False)
    if screen is False:  # built on first use: the packed copy costs memory only where greedy decoding runs
        screen = proj.__dict__["_eyas_screen"] = _build(proj)
    if screen is None or rows.dtype != torch.bfloat16 or rows.requires_grad or rows.is_cuda:
        return None
    b, t, k = rows.shape
    out = screen.logits(rows.reshape(b * t, k))
    return None if out is None else Screened(out.logits.view(b, t, -1), out.greedy.view(b, t))


def screened_logits(proj: nn.Module, rows: torch.Tensor) -> torch.Tensor | None:
    """``screened``'s logits alone: rows [B, T, K] -> [B, T, V], or None where the screen does not serve."""
    out = screened(proj, rows)
    return None if out is None else out.logits


def screen_state(proj: nn.Module | None) -> str | None:
    """How greedy forwards computed ``proj``'s logits: "screened", "full" (the screen does not serve it), or None
    where no greedy forward has asked yet (the choice is made then).
    """
    if proj is None or "_eyas_screen" not in proj.__dict__:
        return None
    return "full" if proj.__dict__["_eyas_screen"] is None else "screened"


def _build(proj: nn.Module) -> ArgmaxScreen | None:
    blocks = attached_blocks(proj)
    if blocks is None or blocks.qtype != Q8_0 or getattr(proj, "bias", None) is not None or _kernel() is None:
        return None
    screen = ArgmaxScreen(blocks)
    return screen if os.environ.get("EYAS_LM_SCREEN", "auto") == "1" or screen_pays(screen) else None


def screen_pays(screen: ArgmaxScreen) -> bool:
    """Whether the screen is faster than the full projection on this machine: both timed on random rows (more
    candidates than a real model's rows give) at ``TIMED_ROWS``, alternating, best of 5 after a warm call each;
    cached per machine and shape.
    """
    def measure() -> dict:
        one_time_note("timing the screened output projection against the full one on this CPU", "~0.5 s")
        g = torch.Generator().manual_seed(0)
        xs = [(3 * torch.randn(r, screen.blocks.k, generator=g)).to(torch.bfloat16) for r in TIMED_ROWS]
        sides = {"full": lambda: [screen.blocks.linear(x, None) for x in xs],
                 "screened": lambda: [screen.logits(x) for x in xs]}
        best = best_alternating(sides, rounds=5, repeats=1)
        return {"full_ms": round(1e3 * best["full"], 4), "screened_ms": round(1e3 * best["screened"], 4),
                "screen": best["screened"] <= PAYS * best["full"]}

    key = machine_key(shape=list(screen.blocks.data.shape), rows=list(TIMED_ROWS), pays=PAYS)
    return bool(cached_json("lm_screen", key, measure)["screen"])
