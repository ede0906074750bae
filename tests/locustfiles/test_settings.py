"""`LoadSettings`: LOAD_* variables, loopback only, the step plan, SLOs per class."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from locustfiles.settings import SLO, LoadSettings


def test_defaults_run_about_a_minute_against_the_local_server() -> None:
    settings = LoadSettings()
    assert settings.host == "http://127.0.0.1:8000"
    assert 60 <= settings.duration_s() <= 90


def test_environment_sets_steps_and_slos(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOAD_STEPS", "2, 6 ,2")
    monkeypatch.setenv("LOAD_STEP_S", "5")
    monkeypatch.setenv("LOAD_SLO_FLEX_TPOT_MS", "80")
    monkeypatch.setenv("LOAD_HOST", "http://localhost:9000/")
    settings = LoadSettings()
    assert settings.user_steps() == [2, 6, 2]
    assert settings.duration_s() == 15
    assert settings.slos()["flex"].tpot_ms == 80
    assert settings.host == "http://localhost:9000"


def test_users_follow_the_steps_and_the_run_ends_after_the_last() -> None:
    settings = LoadSettings(steps="4,8,4", step_s=10)
    assert [settings.users_at(t) for t in (0, 9.9, 10, 25, 29.9)] == [4, 4, 8, 4, 4]
    assert settings.users_at(30) is None


@pytest.mark.parametrize("host", ["http://10.0.0.5:8000", "http://example.com", "ftp://127.0.0.1"])
def test_load_goes_to_loopback_only(host: str) -> None:
    with pytest.raises(ValidationError, match="loopback"):
        LoadSettings(host=host)
    assert LoadSettings(host="http://[::1]:8000").host == "http://[::1]:8000"


@pytest.mark.parametrize("steps", ["", "4,x", "0,0", "4,-2"])
def test_bad_steps_name_the_field(steps: str) -> None:
    with pytest.raises(ValidationError, match="steps"):
        LoadSettings(steps=steps)


def test_slo_needs_both_ttft_and_tpot() -> None:
    slo = SLO(ttft_ms=100, tpot_ms=10)
    assert slo.met(100, 10)
    assert slo.met(50, None)  # one token: no TPOT to hold against it
    assert not slo.met(101, 5)
    assert not slo.met(50, 11)
    assert not slo.met(None, None)  # no first token at all
