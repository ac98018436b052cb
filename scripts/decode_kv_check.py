"""Are a decoded sequence's keys/values the bits a prefill of the same tokens writes? (eyas.kv.prefix keeps only
prefill's, because on the embedded default in bf16 exact mode they are not.)

Per prompt and per side (plain, speculative with the default drafter): decode ``--max-new-tokens``, prefill the
prompt and the answer afresh, and print whether the two caches are equal and the first position where they differ.

python scripts/decode_kv_check.py "Write a short story about a robot learning to paint." "What is 12 times 12?"
python scripts/decode_kv_check.py --blocks-prefill "..."   # bf16 exact prefill on the GGUF blocks, where it is not
"""

from __future__ import annotations

import argparse

import torch

import eyas
from eyas.decode import DecodeConfig, SpecDecoder


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """First slot where two [Lyr, 1, Hk, S, Dh] caches differ, or None."""
    diff = (a != b).any(dim=(0, 1, 2, 4)).nonzero()
    return int(diff[0]) if diff.numel() else None


def blocks_prefill() -> None:
    """A what-if where it is not already so: exact mode's bf16 prefill on the row-invariant GGUF-block kernel
    (decoding's) instead of oneDNN, through the switch eyas.models.exact.linear reads (gguf_tuning.prefill_on_blocks,
    on by itself where the kernel runs several rows in FMAs).
    """
    import eyas.models.exact as exact

    exact._bf16_any_rows = lambda: True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompts", nargs="+")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--blocks-prefill", action="store_true", help="prefill on the GGUF-block kernel (a what-if)")
    a = ap.parse_args()
    if a.blocks_prefill:
        blocks_prefill()
    spec = eyas.load(dtype=a.dtype)
    model = spec.target.model
    for prompt in a.prompts:
        ids = spec.encode(prompt)
        for speculate in (False, True):
            dec = spec.decoder(speculate=speculate, max_new_tokens=a.max_new_tokens)
            seq = dec.prefill(ids)
            while not seq.finished:
                ver = dec.step(seq)
                dec.emit(seq, ver.tokens, ver.num_accepted)
            n = seq.cached
            ref = SpecDecoder(model, None, DecodeConfig(max_new_tokens=1, exact=spec.exact)).prefill(seq.history[:n])
            k = first_difference(seq.cache.k[:, :, :, :n], ref.cache.k[:, :, :, :n])
            v = first_difference(seq.cache.v[:, :, :, :n], ref.cache.v[:, :, :, :n])
            side = "speculative" if speculate else "plain"
            print(f"{prompt[:40]!r} {side}: prompt {ids.shape[0]} + {n - ids.shape[0]} decoded slots; keys "
                  f"{'equal' if k is None else f'differ from slot {k}'}, values "
                  f"{'equal' if v is None else f'differ from slot {v}'}")


if __name__ == "__main__":
    main()
