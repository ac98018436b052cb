"""eyas: lossless speculative decoding (EAGLE-1/2, n-gram, draft LM) on Llama-family targets."""

from eyas.api import GenerationResult, Speculator, load
from eyas.decode import DecodeConfig, SpecDecoder
from eyas.types import SamplingParams

__all__ = ["DecodeConfig", "GenerationResult", "SamplingParams", "SpecDecoder", "Speculator", "load"]
__version__ = "0.1.0"
