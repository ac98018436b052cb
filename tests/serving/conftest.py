"""A live server on a free port: uvicorn in a background thread, embedded model, fp32, ngram drafter.

``fake_spec`` gives a model-free Speculator stand-in whose steps are as slow as a test wants.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from eyas.decode import StepEvent
from eyas.types import RequestSettings, StepStats

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


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(f"t{i} " for i in ids if i != 0)


class FakeBatch:
    """BatchDecoder's interface: every row emits one token per step (token i + 1 at step i)."""

    policy = None

    def __init__(self, spec: FakeSpec) -> None:
        self.spec, self.rows = spec, {}

    def __len__(self) -> int:
        return len(self.rows)

    def calibrate(self) -> None:
        pass

    def add(self, key, ids, settings: RequestSettings) -> StepEvent:
        if self.spec.fail:
            raise RuntimeError("boom")
        row = SimpleNamespace(i=0, n=settings.max_new_tokens, stats=StepStats(), cached_prompt_tokens=0)
        self.rows[key] = row
        return self._event(row)

    def step(self) -> list:
        self.spec.gate.wait(10)
        time.sleep(self.spec.delay)
        self.spec.steps += 1
        return [(k, self._event(r)) for k, r in list(self.rows.items())]

    def remove(self, key) -> None:
        del self.rows[key]

    def decoder(self, key):
        return self.rows[key]

    @staticmethod
    def _event(row) -> StepEvent:
        i = row.i
        row.i += 1
        if i:
            row.stats.record(2, 1)
        return StepEvent(tokens=torch.tensor([i + 1]), num_accepted=min(i, 1), finished=i == row.n - 1)


class FakeSpec:
    tokenizer = FakeTokenizer()
    target = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=100000)))

    def __init__(self) -> None:
        self.gate, self.delay, self.steps, self.fail = threading.Event(), 0.0, 0, False
        self.encode_delay = 0.0  # seconds each encode takes (a huge prompt, a slow template)
        self.gate.set()

    def encode(self, prompt, chat: bool = True) -> torch.Tensor:
        time.sleep(self.encode_delay)
        return torch.arange(3)

    def stop_ids(self) -> tuple[int, ...]:
        return (0,)

    def batch_decoder(self, max_batch: int, policy=None) -> FakeBatch:
        return FakeBatch(self)


@pytest.fixture(scope="session")
def fake_spec():
    """The FakeSpec class: a zero-argument factory of fresh fakes."""
    return FakeSpec
