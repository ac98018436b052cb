"""An EAGLE-3 head's whole call on the CPU as one native call (``eyas/kernels/head_step.cpp``).

A drafting step runs its head right after the verify forward streamed the target's weights through the caches, so
each of the ~25 torch ops of a head call (the fused taps, embedding, norms, RoPE rows, residuals, silu, vocabulary
head, log-softmax, top-k) pays for its code coming back from DRAM: on the Zen 4 VM an extension's call over 2 rows
took ~1.4 ms first after the target's projections and ~0.48 ms in a hot loop, ~0.68 and ~0.25 as one native call
(``scripts/head_step_cold.py``, docs/benchmarks.md). ``HeadStep`` runs the same kernels (the taps' Q8_0 projection,
int8 projections, RoPE into the cache, path attention, RMSNorm) from one entry::

    out = step(tokens, hid [P, D], rows | None, pos0, pos_step, cache, write_start, prefix, seen, logits_from, top_k)

with the same roundings as the torch fast path (``fuse``, ``fast_forward``, then ``_logp``) except silu and
log-softmax (kernels/vexp.h's SIMD exp against torch's: the last float bits), and each row's top-k already mapped to
target ids for the tree's books. Tokens, rows and paths go in as Python lists: no tensor is made for them. Only the
draft can change; verification keeps the output lossless. It serves where the head is an ``Eagle3Head`` whose
decoder layers (EAGLE-3's, then any plain layers after it: ``--head-layers``) have int8-row projections, as its
vocabulary head has (eyas.models.int8_rows), the target's embedding is a dense table in the head's dtype, the kernel
builds and ``EYAS_HEAD_STEP`` is not 0; elsewhere the drafter keeps the torch fast path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from eyas import kernels
from eyas.kv.static import KVCache
from eyas.models.gguf_blocks import GGUFBlocks, attached_blocks
from eyas.models.int8_rows import Int8Rows, prefetch_from_env

_kernel = kernels.Lazy(kernels.head_step, usable=lambda k: k.available())
_NO_HID = torch.empty(0, 0)  # run's hid where the call fuses the taps itself


@dataclass
class HeadOut:
    """One head call's results."""

    hidden: torch.Tensor  # [T, D] the rows' outputs before the final norm, in the head's dtype
    logp: torch.Tensor  # [R, V_draft] float32 draft log-probs of the last R rows (R = T - logits_from)
    # ([R, k] float32 log-probs, [R, k] long target ids) of each of those rows' k best, best first; None where the
    # call was not asked for them (the torch path, a static tree)
    top: tuple[torch.Tensor, torch.Tensor] | None = None

    def last(self) -> HeadOut:
        """The last row's results, each keeping a leading dimension of 1."""
        top = None if self.top is None else (self.top[0][-1:], self.top[1][-1:])
        return HeadOut(self.hidden[-1:], self.logp[-1:], top)


def _layer_projs(layer: nn.Module) -> list | None:
    """A decoder layer's q|k|v, o, gate|up and down as the kernel takes them (``Int8Rows.kernel_weights``), or None
    where one of them is not int8 rows.
    """
    attn, mlp = layer.self_attn, layer.mlp
    projs = [attn.__dict__.get("_eyas_fused"), attached_blocks(attn.o_proj), mlp.__dict__.get("_eyas_fused"),
             attached_blocks(mlp.down_proj)]
    return [p.kernel_weights() for p in projs] if all(isinstance(p, Int8Rows) for p in projs) else None


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
        if not (hasattr(head, "midlayer") and head.fast_ready()):
            return None
        dtype = head.fc.weight.dtype
        if not isinstance(embedding, nn.Embedding) or embedding.weight.dtype != dtype:
            return None
        ml, later = head.midlayer, list(head.extra_layers)
        first, lm = _layer_projs(ml), attached_blocks(head.lm_head)
        later_projs = [_layer_projs(layer) for layer in later]
        if (first is None or any(p is None for p in later_projs) or not isinstance(lm, Int8Rows)
                or head.lm_head.bias is not None):
            return None
        norms = [ml.input_layernorm, ml.hidden_norm, ml.post_attention_layernorm, head.norm]
        eps = {n.eps for n in norms} | {n.eps for x in later for n in (x.input_layernorm, x.post_attention_layernorm)}
        if len(eps) != 1:
            return None
        fc = attached_blocks(head.fc)  # the fused taps' projection: here where it is bf16 Q8_0 blocks, else in Python
        fc_data, fc_code = (fc.operands(dtype) if isinstance(fc, GGUFBlocks) and dtype == torch.bfloat16
                            and head.fc.bias is None else (torch.empty(0, dtype=torch.uint8), -1))
        extra = [(x.input_layernorm.weight.detach(), x.post_attention_layernorm.weight.detach(), *projs)
                 for x, projs in zip(later, later_projs, strict=True)]
        attn = ml.self_attn
        native = _kernel().HeadStep(embedding.weight.detach(), [n.weight.detach() for n in norms], norms[0].eps,
                                    *first, lm.kernel_weights(), head.draft_ids().cpu(), fc_data, fc_code,
                                    attn.h, attn.hk, attn.dh, head.cfg.norm_before_residual, prefetch_from_env(),
                                    extra)
        return cls(native, head)

    @property
    def fuses(self) -> bool:
        """Whether the call projects the fused taps itself (``taps``): a bf16 head whose ``fc`` is Q8_0 blocks."""
        return self.native.fuses

    def __call__(self, tokens: list[int], hid: torch.Tensor | None, rows: list[int] | None, pos0: int, pos_step: int,
                 cache: KVCache, write_start: int, prefix: int, seen: list[list[int]], logits_from: int,
                 top_k: int = 0, taps: list[torch.Tensor] | None = None) -> HeadOut:
        """Row i: ``tokens[i]``, feature ``hid[rows[i]]`` (``hid[i]`` without rows; hid [P, D] in the head's dtype),
        position pos0 + pos_step * i; its k and v go to slot write_start + i of ``cache`` (decoder layer l's to cache
        layer l, one sequence, float32); it attends slots 0 .. prefix - 1, then prefix + j for each j of ``seen[i]``
        (its path, itself last: ``HeadPaths.from_seen``'s). Log-probs for rows logits_from .. T - 1, with their
        ``top_k`` best (0: none).
        ``taps`` (where ``fuses``; then no hid, no rows): the target's taps [T, D_target] each, row i feeding row i,
        projected here as ``Eagle3Head.fuse`` does.
        """
        cos, sin = self.rope.tables(cache.max_slots, cache.k.device)
        hid = _NO_HID if hid is None else hid.contiguous()
        out, logp, values, ids = self.native.run(tokens, hid, taps or [], rows or [], cos, sin, pos0, pos_step,
                                                 cache.k, cache.v, write_start, prefix, seen, logits_from, top_k)
        return HeadOut(out, logp, (values, ids) if top_k else None)
