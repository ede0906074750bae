"""Request classification: header, then service tier, then the default."""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from engine.errors import InvalidRequest
from engine.request import RequestClass
from policies.base import create
from policies.request_class import RequestClassPolicy

BULK, INTERACTIVE = RequestClass.BULK, RequestClass.INTERACTIVE


def classify(headers: dict[str, str] | None = None, body: dict | None = None, **options):
    policy = create(RequestClassPolicy, "header", **options)
    return policy.classify(Headers(headers or {}), body or {})


def test_default_is_interactive_and_configurable():
    assert classify() is INTERACTIVE
    assert classify(default="bulk") is BULK


@pytest.mark.parametrize("tier, expected", [
    ("flex", BULK), ("batch", BULK), ("Flex", BULK), ("default", INTERACTIVE),
    ("auto", INTERACTIVE), (None, INTERACTIVE), (3, INTERACTIVE),
])  # fmt: skip
def test_service_tier(tier, expected):
    assert classify(body={"service_tier": tier}) is expected


def test_header_wins_over_service_tier_case_insensitively():
    assert classify({"X-Firstlight-Class": "interactive"}, {"service_tier": "flex"}) is INTERACTIVE
    assert classify({"x-firstlight-class": " BULK "}) is BULK


def test_invalid_header_names_the_header():
    with pytest.raises(InvalidRequest) as err:
        classify({"x-firstlight-class": "urgent"})
    param, message = err.value.param, err.value.message
    assert param == "x-firstlight-class" and "interactive" in message


def test_fixed_policy_ignores_the_request():
    policy = create(RequestClassPolicy, "fixed", request_class="bulk")
    assert policy.classify(Headers({"x-firstlight-class": "interactive"}), {}) is BULK
    assert {"fixed", "header"} <= set(RequestClassPolicy.available())
