"""A one-layer EAGLE-3 head's whole call on the CPU as one native call (``eyas/kernels/head_step.cpp``).

A drafting step runs its head right after the verify forward streamed the target's weights through the caches, so
each of the ~25 torch ops of a head call (embedding, norms, RoPE rows, residuals, silu, vocabulary head,
log-softmax) pays for its code coming back from DRAM. Measured on the Zen 4 VM (bf16, 2 rows): a head call took
~0.94 ms first after the target's projections and ~0.30 ms in a hot loop. ``HeadStep`` runs the same kernels
(int8 projections, RoPE into the cache, path attention, RMSNorm) from one entry::

    out, logp = step(tokens [T], hid [P, D], rows [T] | None, pos0, pos_step, write_start, paths, logits_from)

with the same roundings as the torch fast path (``fast_forward`` then ``_logp``) except silu and log-softmax
(libm's exp against torch's vectorised one: the last float bit). Only the draft can change; verification keeps the
output lossless. It serves where the head is an ``Eagle3Head`` with one decoder layer whose five projections are
int8 rows (eyas.models.int8_rows), the target's embedding is a dense table in the head's dtype, the kernel builds
and ``EYAS_HEAD_STEP`` is not 0; elsewhere the drafter keeps the torch fast path.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from eyas import kernels
from eyas.drafters.head_kernels import HeadPaths
from eyas.kv.static import KVCache
from eyas.models.gguf_blocks import attached_blocks
from eyas.models.int8_rows import Int8Rows, prefetch_from_env

_kernel = kernels.Lazy(kernels.head_step, usable=lambda k: k.available())
_NO_ROWS = torch.empty(0, dtype=torch.long)


class HeadStep:
    """The compiled call for one head (``build`` makes it, or says why not by returning None)."""

    def __init__(self, native, head: nn.Module) -> None:
        self.native = native  # the C++ HeadStep: weights and shapes, held for the head's life
        self.rope = head.rope_table

    @classmethod
    def build(cls, head: nn.Module, embedding: nn.Module | None) -> HeadStep | None:
        """The compiled call for ``head`` drafting with ``embedding`` (the target's token embedding), or None where it
        does not serve (see the module docstring).
        """
        if os.environ.get("EYAS_HEAD_STEP", "1") == "0" or _kernel() is None:
            return None
        if not (hasattr(head, "midlayer") and len(head.extra_layers) == 0 and head.fast_ready()):
            return None
        dtype = head.fc.weight.dtype
        if not isinstance(embedding, nn.Embedding) or embedding.weight.dtype != dtype:
            return None
        ml = head.midlayer
        attn, mlp = ml.self_attn, ml.mlp
        projs = [attn.__dict__.get("_eyas_fused"), attached_blocks(attn.o_proj), mlp.__dict__.get("_eyas_fused"),
                 attached_blocks(mlp.down_proj), attached_blocks(head.lm_head)]
        if not all(isinstance(p, Int8Rows) for p in projs) or head.lm_head.bias is not None:
            return None
        norms = [ml.input_layernorm, ml.hidden_norm, ml.post_attention_layernorm, head.norm]
        if len({n.eps for n in norms}) != 1:
            return None
        native = _kernel().HeadStep(embedding.weight.detach(), [n.weight.detach() for n in norms], norms[0].eps,
                                    *[p.kernel_weights() for p in projs], attn.h, attn.hk, attn.dh,
                                    head.cfg.norm_before_residual, prefetch_from_env())
        return cls(native, head)

    def __call__(self, tokens: torch.Tensor, hid: torch.Tensor, rows: torch.Tensor | None, pos0: int, pos_step: int,
                 cache: KVCache, write_start: int, paths: HeadPaths,
                 logits_from: int) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [T] long; hid [P, D] in the head's dtype, row ``rows[i]`` (or i, without rows) feeding row i; row i
        at position pos0 + pos_step * i, its k and v written to slot write_start + i of ``cache`` (layer 0, one
        sequence, float32) -> (outputs [T, D] before the final norm, draft log-probs [T - logits_from, V_draft]
        float32).
        """
        cos, sin = self.rope.tables(cache.max_slots, tokens.device)
        return self.native.run(tokens, hid.contiguous(), _NO_ROWS if rows is None else rows, cos, sin, pos0, pos_step,
                               cache.k, cache.v, write_start, paths.prefix, paths.slots, paths.lengths, logits_from)
