"""Request bodies the parser must refuse cleanly (400), never with a 500."""

from __future__ import annotations

import pytest

from app.openai.body import MAX_DEPTH, check_body, parse_body
from app.openai.errors import APIError


def refused(raw: bytes | dict) -> APIError:
    with pytest.raises(APIError) as err:
        check_body(parse_body(raw) if isinstance(raw, bytes) else raw)
    assert err.value.status == 400
    return err.value


def test_deep_nesting_is_400_at_any_depth():
    assert "nested" in refused(b"[" * 5000 + b"]" * 5000).message  # past the recursion limit
    assert "nested" in refused(b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}").message
    body = b'{"metadata":' + b"[" * 200 + b"]" * 200 + b"}"  # parses, still refused
    assert refused(body).param is not None
    ok = b'{"a":' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}"
    check_body(parse_body(ok))


def test_lone_surrogates_name_their_field():
    error = refused(b'{"messages":[{"role":"user","content":"hi \\ud800"}]}')
    assert error.param == "messages[0].content" and "surrogate" in error.message
    assert refused({"stop": ["ok", "\udfff"]}).param == "stop[1]"
    assert refused({"metadata": {"\ud800": 1}}).param == "metadata"
    fine = parse_body('{"content":"\\ud83d\\ude42 café"}'.encode())
    check_body(fine)
    assert fine["content"] == "🙂 café"


def test_other_bad_bodies():
    assert "JSON" in refused(b'{"model": ').message
    assert "JSON object" in refused(b"[1]").message
    assert "JSON" in refused(b"\xff\xfe").message
