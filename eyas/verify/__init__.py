"""Verification: decide which draft tokens the target accepts. Pure functions.

Glossary (as in vLLM's ``RejectionSampler``), for one step over a tree whose
root is the last token already emitted:

accepted tokens
    Draft tokens the target keeps: the tokens of ``VerifyOutput.path[1:]``, a
    root path through the tree. Under greedy verification a draft token is
    accepted iff it equals the target's argmax after its parent; under sampling
    verification it is accepted with probability ``min(1, p(x) / q(x))``
    (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318).
recovered token
    The token the target samples at the last accepted node when it rejected
    every child of that node. In sampling verification it is drawn from the
    residual ``normalise(max(p - q, 0))`` left after the rejections, which is
    what makes the step lossless; for trees the residual is updated sibling by
    sibling (SpecInfer's multi-step speculative sampling, Miao et al. 2023,
    arXiv 2305.09781).
bonus token
    The token the target samples when the last accepted node is a leaf: every
    draft on the path was accepted, and the target's own output after the leaf
    comes for free, drawn from its unmodified distribution there.
emitted (output) tokens
    ``VerifyOutput.tokens`` = accepted tokens followed by exactly one recovered
    or bonus token, so each step emits between 1 and depth + 1 tokens. The last
    emitted token becomes the root of the next step's tree.

Lossless means the emitted sequence has exactly the distribution plain
decoding with the target would produce: ``verify_greedy`` (temperature 0) and
``verify_sampling`` are lossless; ``verify_typical`` (Medusa) is not.

All randomness comes from an explicit ``torch.Generator`` argument.
"""

from eyas.verify.greedy import verify_greedy
from eyas.verify.rejection import verify_sampling
from eyas.verify.sampling import greedy, logits_to_probs, sample
from eyas.verify.typical import LOSSY_NOTE, TypicalConfig, verify_typical

__all__ = [
    "LOSSY_NOTE",
    "TypicalConfig",
    "greedy",
    "logits_to_probs",
    "sample",
    "verify_greedy",
    "verify_sampling",
    "verify_typical",
]
