"""Live servers for the load benchmark: the real eyas app (embedded SmolLM2, fp32, ngram) and stubs.

The uvicorn helpers come from the serving tests' conftest, loaded by path (pytest runs in
importlib mode, so ``tests.serving.conftest`` is not importable as a package module).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SERVED = "SmolLM2-135M-Instruct"  # what `eyas serve` calls the embedded model: the default tokenizer


def _serving_helpers():
    path = Path(__file__).resolve().parents[1] / "serving" / "conftest.py"
    spec = importlib.util.spec_from_file_location("_eyas_serving_test_helpers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def serve():
    """A function app -> base URL serving the app until the module's tests end."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    helpers, started = _serving_helpers(), []

    def _serve(app) -> str:
        server, thread, url = helpers.start_server(app)
        started.append((server, thread))
        return url

    yield _serve
    for server, thread in started:
        helpers.stop_server(server, thread)


@pytest.fixture(scope="module")
def eyas_url(default_target, serve):
    """The real eyas server around the embedded model (fp32) with the ngram drafter."""
    from eyas.api import Speculator
    from eyas.drafters.loading import DrafterSpec
    from eyas.serving.app import create_app
    from eyas.serving.engine import ServeLimits

    spec = Speculator(default_target, DrafterSpec("ngram"))
    # full trees always: under "auto" the measured policy may (rightly) decode plainly on a slow
    # CPU, and whether the speculative side drafts would then depend on timing
    limits = ServeLimits(
        max_queue=16, max_tokens=64, max_prompt_tokens=256, spec_policy="always", calibrate=False
    )
    return serve(create_app(spec, SERVED, limits))
