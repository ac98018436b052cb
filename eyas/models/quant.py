"""Weight-only int8 quantization of the native target (``--quantize int8``).

Every projection (q/k/v, o, gate/up, down, and the vocabulary projection) keeps its weight as
int8 with one scale per output row (symmetric, absmax / 127); activations stay in the model dtype.
On a CPU the product runs in torch's int8-weight kernel (``torch._weight_int8pack_mm``): measured on
the AVX512-BF16 VM, 1 thread, bf16 activations, one row: 1.6-1.9x faster than the bf16 GEMV for
SmolLM2's shapes (the [49152, 576] vocabulary projection 4.8 ms vs 8.1 ms), break-even near 2-3 rows
and slower beyond (docs/benchmarks.md, "--quantize int8"; on a GGUF target the bf16 block kernel
is faster). Elsewhere (GPU) the weight is dequantised on the fly, which computes the same quantized model.

Quantizing changes the model: outputs differ from the bf16 / fp32 model's. Speculative decoding
stays lossless with respect to the quantized model (the target *is* the int8 model; the drafter
only proposes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZE_CHOICES = ("none", "int8")


class Int8Linear(nn.Module):
    """y = x @ (weight_int8 * scales[:, None]).T + bias; weight [N, K] int8, scales [N] in the activation dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
        self.register_buffer("weight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] -> [..., N] in x's dtype."""
        rows = x.reshape(-1, self.in_features)
        if x.device.type == "cpu":
            y = torch._weight_int8pack_mm(rows, self.weight, self.scales.to(x.dtype))
        else:
            y = F.linear(rows, self.weight.to(x.dtype) * self.scales.to(x.dtype)[:, None])
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """[N, K] float32: the weight this layer computes with."""
        return self.weight.float() * self.scales.float()[:, None]


def quantize_int8_(model: nn.Module, skip: tuple[str, ...] = ("embed_tokens",)) -> int:
    """Replace every nn.Linear under ``model`` (names not containing ``skip``) by an Int8Linear; returns the count.

    Tied weights: a vocabulary projection tied to the embedding gets its own int8 copy, the
    embedding keeps its floating-point table.
    """
    count = 0
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and not any(s in full for s in skip):
                setattr(mod, child_name, Int8Linear(child))
                count += 1
    return count
