"""llama.cpp (through llama-cpp-python) as the CPU peer of ``eyas bench speed --compare-llamacpp``.

Plain greedy decoding of the same GGUF file on the same prompt token ids, timed apart: prompt
processing (one ``eval`` of the prompt) and decoding (one ``eval`` per generated token, argmax of
its logits). Weights caveat (``weights_caveat``): where eyas's projections read the GGUF file's blocks
(a GGUF target on a CPU, eyas.models.gguf_blocks) both sides stream the same quantized bytes and differ in
arithmetic (llama.cpp rounds the activations to 8 bits); elsewhere eyas computes on weights dequantized to
bf16/fp32 once and llama.cpp streams about 4x fewer weight bytes per token. Greedy texts may differ.

Optional: ``pip install 'eyas[llamacpp]'`` builds llama-cpp-python from source
(``CMAKE_ARGS="-DGGML_NATIVE=ON"``, about 8 minutes on 2 cores); never part of the default install or CI.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def weights_caveat(reads_blocks: bool) -> str:
    """What differs between the two sides' weights; reads_blocks: eyas's target projections read the GGUF's blocks."""
    if reads_blocks:
        return ("both read the GGUF's quantized weights (Q4_1 / Q8_0 blocks here): llama.cpp multiplies them with "
                "activations rounded to 8 bits, eyas dequantizes them in registers to its --dtype; texts may differ")
    return ("llama.cpp computes on the GGUF's quantized weights (Q4_1 here); eyas on weights dequantized to its "
            "--dtype, so llama.cpp reads ~4x fewer weight bytes per token; texts may differ")


@dataclass
class LlamaCppRun:
    token_ids: list[int]
    prompt_tokens: int
    prompt_seconds: float  # prompt eval + the first token
    decode_seconds: float  # after the first token: new_tokens - 1 evals

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


class LlamaCppPeer:
    """One llama.cpp context over ``gguf``, reused for every prompt."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int = 4096) -> None:
        try:
            from llama_cpp import Llama
        except ImportError:
            raise RuntimeError(
                "--compare-llamacpp needs llama-cpp-python: CMAKE_ARGS='-DGGML_NATIVE=ON' pip install "
                "llama-cpp-python (builds from source, about 8 minutes on 2 cores)"
            ) from None
        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, logits_all=False, verbose=False)

    def run(self, prompt_ids: list[int], max_new: int, stop_ids: tuple[int, ...]) -> LlamaCppRun:
        """Greedy decode of up to ``max_new`` tokens after ``prompt_ids``."""
        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt_ids)
        tok = self._greedy()
        t1 = time.perf_counter()
        out = [tok]
        while len(out) < max_new and tok not in stop_ids:
            llm.eval([tok])
            tok = self._greedy()
            out.append(tok)
        t2 = time.perf_counter()
        return LlamaCppRun(token_ids=out, prompt_tokens=len(prompt_ids), prompt_seconds=t1 - t0, decode_seconds=t2 - t1)

    def _greedy(self) -> int:
        """Argmax of the last evaluated token's logits, read from the context: without ``logits_all``
        llama-cpp-python's ``Llama.eval`` leaves ``Llama.scores`` unwritten (zeros), so reading it picks token 0.
        """
        from llama_cpp import llama_get_logits_ith

        logits = np.ctypeslib.as_array(llama_get_logits_ith(self.llm.ctx, -1), shape=(self.llm.n_vocab(),))
        return int(np.argmax(logits))


def gguf_of(spec) -> Path:
    """The GGUF file eyas loaded the target from (the embedded model's, or a --model x.gguf)."""
    from eyas.models.loading import DEFAULT_MODEL, embedded_gguf_path

    name = spec.target.name
    if name == DEFAULT_MODEL:
        return embedded_gguf_path()
    if str(name).endswith(".gguf") and Path(name).is_file():
        return Path(name)
    raise ValueError(f"--compare-llamacpp needs a GGUF target (the embedded default or --model FILE.gguf), got {name}")
