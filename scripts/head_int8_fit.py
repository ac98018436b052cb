"""What int8 projections cost a draft head's accuracy: teacher-forced top-1 by depth, projection by projection.

The int8 head kernel (eyas/kernels/head_i8.cpp) rounds each weight row to int8 and each input row to int8 with its
own scale. This simulates exactly that rounding in torch (weights per row, inputs per row, round half to even) on
the head's reference path and measures, on the target's own greedy answers to tuning questions, how often the
head's top-1 is the target's token at depths 1-3 (scripts/acceptance_profile.py's teacher-forced unroll), for: the
float head, Q8_0 weights (the block kernel's), int8 rows everywhere, and int8 rows on one projection at a time. A
projection whose int8 inputs cost accuracy keeps the Q8_0 float path (eyas.models.gguf_blocks.quantize_head_: the
fused taps ``fc``). Tuning questions only, never evaluation sets.

python scripts/tune_questions.py --out /tmp/tune.jsonl
python scripts/head_int8_fit.py --questions /tmp/tune.jsonl --limit 24
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from eyas.train.profile import depth_counts, ranks_along

PROJECTIONS = {"fc": ("fc",), "q|k|v": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
               "gate|up": ("gate_proj", "up_proj"), "down": ("down_proj",), "lm_head": ("lm_head",)}


def int8_rows_(head: torch.nn.Module, inputs_of: tuple[str, ...] | None, skip: tuple[str, ...] = ()) -> None:
    """Every projection's weight rounded per row to int8; inputs too for the projections named in ``inputs_of``
    (None: all), as the kernel does: scale max |row| / 127, round half to even, clamp to +-127. Projections named in
    ``skip`` are left as they are.
    """
    from eyas.models.int8_rows import Int8Rows

    def fake(x: torch.Tensor) -> torch.Tensor:  # the kernel's own rounding (Int8Rows.quantize), back to float
        return Int8Rows.quantize(x.reshape(-1, x.shape[-1])).dequantize().view_as(x)

    for name, mod in head.named_modules():
        if not isinstance(mod, torch.nn.Linear) or name.split(".")[-1] in skip:
            continue
        mod.weight.data = fake(mod.weight.data)
        if inputs_of is None or name.split(".")[-1] in inputs_of:
            mod.register_forward_pre_hook(lambda m, args: (fake(args[0]),))


def q8_0_(head: torch.nn.Module) -> None:
    """Every projection's weight as its Q8_0 rounding (the block kernel's weights, as quantize_head_ sets them)."""
    from eyas import kernels
    from eyas.models.gguf_blocks import _SUPPORTED, quantize_q8_0

    for mod in head.modules():
        if isinstance(mod, torch.nn.Linear):
            w = mod.weight.data
            mod.weight.data = kernels.gguf_f32().dequantize(quantize_q8_0(w), _SUPPORTED["Q8_0"], w.shape[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head", default="eyas/heads/smollm2-135m-instruct-eagle3")
    ap.add_argument("--questions", required=True)
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32", help="the target's dtype for the greedy answers and features")
    a = ap.parse_args()
    import eyas
    from eyas.formats.eagle3 import load_eagle3

    spec = eyas.load(drafter="none", dtype=a.dtype)
    target = spec.target.model
    texts = []
    for q in [json.loads(line)["turns"][0] for line in open(a.questions)][: a.limit]:
        prompt = spec.encode(q)
        answer = spec.generate(q, max_new_tokens=a.max_new_tokens, speculate=False).token_ids
        texts.append((torch.cat([prompt, torch.tensor(answer, dtype=torch.long)]), prompt.shape[0]))
    arms = {"float": lambda h: None, "Q8_0 weights": q8_0_, "int8 rows, every input": lambda h: int8_rows_(h, None),
            "int8 rows but fc (Q8_0): as shipped": lambda h: (q8_0_(h), int8_rows_(h, None, skip=("fc",)))}
    arms.update({f"int8 rows, inputs of {k} only": (lambda h, v=v: int8_rows_(h, v)) for k, v in PROJECTIONS.items()})
    print(f"{len(texts)} texts; teacher-forced top-1 at depth 1 / 2 / 3")
    for name, make in arms.items():
        head = load_eagle3(Path(a.head), target.config, torch.float32).float()
        make(head)
        seen, hits = torch.zeros(3), torch.zeros(3, 1)
        for ids, p in texts:
            s, h = depth_counts(ranks_along(target, head, ids, 3), p - 1, 1)
            seen, hits = seen + s, hits + h
        top1 = (hits[:, 0] / seen).tolist()
        print(f"{name:36s} " + " / ".join(f"{x:.4f}" for x in top1), flush=True)


if __name__ == "__main__":
    main()
