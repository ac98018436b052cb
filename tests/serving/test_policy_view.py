"""``GET /v1/eyas/policy``: the mode the server was started with, and the engine's published snapshot.

Issue 14: a server started with the default ``--spec-policy auto`` reported ``"mode": "always"``
(exact mode keeps full trees); it now reports ``auto`` plus the mode in effect and why. The
engine publishes the snapshot under a lock, so a reader never races the worker (no 503).
"""

from __future__ import annotations

import threading

import httpx
import pytest

MODEL = "smol"


@pytest.fixture(scope="module")
def make_url(launch, default_target):
    from eyas.api import Speculator
    from eyas.drafters.loading import DrafterSpec
    from eyas.serving.app import create_app
    from eyas.serving.engine import ServeLimits

    def _make(drafter: str, policy: str, exact: bool | None = None) -> str:
        spec = Speculator(default_target, DrafterSpec(drafter), exact=exact)
        return launch(create_app(spec, MODEL, ServeLimits(max_tokens=64, spec_policy=policy, calibrate=False)))

    return _make


def test_exact_server_reports_the_mode_it_was_started_with(make_url):
    view = httpx.get(make_url("ngram", "auto", exact=True) + "/v1/eyas/policy").json()
    assert view["mode"] == "auto" and "tau" in view and view["running"] == 0, view
    # where exact mode overrides the policy, the view says so and why
    assert view["effective_mode"] == "auto" or "exact" in view["reason"], view


@pytest.mark.parametrize("policy", ["auto", "never", "always"])
def test_mode_as_configured(make_url, policy):
    view = httpx.get(make_url("ngram", policy, exact=False) + "/v1/eyas/policy").json()
    assert view["mode"] == view["effective_mode"] == policy and "reason" not in view, view


def test_no_drafter(make_url):
    assert httpx.get(make_url("none", "auto") + "/v1/eyas/policy").json() == {"mode": "none", "reason": "no drafter"}


def test_snapshot_readable_while_decoding(make_url):
    url = make_url("ngram", "auto", exact=False)
    body = {"model": MODEL, "prompt": "a b c a b c a b c", "max_tokens": 64, "temperature": 0}
    t = threading.Thread(target=lambda: httpx.post(url + "/v1/completions", json=body, timeout=120))
    t.start()
    codes = [httpx.get(url + "/v1/eyas/policy").status_code for _ in range(40)]
    t.join(120)
    assert codes == [200] * 40
    assert sum(httpx.get(url + "/v1/eyas/policy").json()["tau_observations"].values()) > 0  # republished
