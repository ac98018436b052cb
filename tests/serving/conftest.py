"""A live server on a free port: uvicorn in a background thread, embedded model, fp32, ngram drafter."""

from __future__ import annotations

import threading
import time

import pytest

MODEL = "smol"


def start_server(app):
    """Run ``app`` with uvicorn on 127.0.0.1 and a free port; returns (server, thread, base_url)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (server.started and server.servers):
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://127.0.0.1:{port}"


def stop_server(server, thread) -> None:
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def spec(default_target):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from eyas.api import Speculator
    from eyas.drafters.loading import DrafterSpec

    return Speculator(default_target, DrafterSpec("ngram"))


@pytest.fixture(scope="module")
def launch():
    """A function app -> base URL that serves the app until the module's tests end."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    started = []

    def _launch(app) -> str:
        server, thread, url = start_server(app)
        started.append((server, thread))
        return url

    yield _launch
    for server, thread in started:
        stop_server(server, thread)


@pytest.fixture(scope="module")
def base_url(spec, launch):
    from eyas.serving.app import create_app
    from eyas.serving.engine import ServeLimits

    # full trees always (the policy would switch a CPU-bound tiny run to plain decoding, and
    # tests of drafting statistics need drafts); tests/serving/test_batching.py covers "auto"
    limits = ServeLimits(
        max_queue=8, max_tokens=64, max_prompt_tokens=256, spec_policy="always", calibrate=False
    )
    return launch(create_app(spec, MODEL, limits))


@pytest.fixture(scope="module")
def client(base_url):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
