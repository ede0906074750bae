"""The playground page on the real application (Ray Serve, demo model) in headless Chromium:
a person sends a prompt, watches it stream with its timing, presses Stop mid-answer, and the
server counts the cancel and gives the request's KV blocks back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.playground.browser import Chromium, Playground, find_chromium, headless_chromium
from tests.actors.helpers import require_demo_model, serve_app, small_config

pytestmark = [pytest.mark.serve, pytest.mark.slow]

LONG_ANSWER = 1500  # tokens: seconds of streaming on CPU, so Stop lands mid-answer


@pytest.fixture(scope="module")
def chromium() -> Chromium:
    found = find_chromium()
    if isinstance(found, str):
        pytest.skip(found)
    return found


@pytest.fixture(scope="module")
def url(chromium: Chromium) -> Iterator[str]:
    require_demo_model()
    with serve_app(small_config(), namespace="firstlight-playground") as base:
        yield base


def counter(url: str, name: str) -> float:
    """The sum of a counter's series in one `/metrics` scrape."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == name
        for sample in family.samples
        if sample.name == name + "_total"
    )


def status(url: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/status", timeout=10)
    response.raise_for_status()
    return response.json()


def idle_status(url: str) -> dict[str, Any] | None:
    """`/status` once an engine has reported and nothing runs or waits, else None."""
    summary = status(url)
    busy = any(summary["running"].values()) or any(summary["waiting"].values())
    return summary if summary["engines"] and not busy else None


def wait_for(condition: Any, timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)
    return value


def painted_pixels(driver: Any, canvas_id: str) -> int:
    return driver.execute_script(
        "const c = document.getElementById(arguments[0]);"
        "const data = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        "let n = 0; for (let i = 3; i < data.length; i += 4) if (data[i]) n++; return n;",
        canvas_id,
    )


def is_figure(text: str) -> bool:
    return text.endswith((" ms", " s"))


def test_stream_then_stop_mid_answer_from_the_page(url: str, chromium: Chromium) -> None:
    with headless_chromium(chromium) as driver:
        page = Playground(driver, url)
        page.wait_for(lambda: page.text("svc-state") == "1 replica")

        # a whole (short) answer: streamed text, browser and server timing side by side
        page.set("max-tokens", "16")
        page.send("Can I pause my annual subscription?")
        page.wait_for(lambda: not page.busy())
        assert page.last_answer()
        assert page.text("error") == ""
        for figure in ("b-ttft", "b-itl50", "s-queue", "s-prefill", "s-ttft", "s-decode"):
            assert is_figure(page.text(figure)), (figure, page.text(figure))
        assert int(page.text("s-tokens")) > 0

        baseline_kv = wait_for(lambda: idle_status(url))["kv_usage"]
        cancelled = counter(url, "firstlight_request_cancelled")
        aborted = counter(url, "firstlight_num_aborted")

        # a long answer, stopped as soon as text and a TTFT figure are on the page
        page.set("max-tokens", str(LONG_ANSWER))
        page.tick("ignore-eos")
        page.send("Tell me everything about refunds.")
        page.wait_for(lambda: page.last_answer() and is_figure(page.text("b-ttft")))
        assert page.busy(), "the answer ended before Stop could be pressed"
        page.stop()
        page.wait_for(lambda: not page.busy())
        assert "stopped" in driver.find_elements("css selector", ".message.assistant")[-1].text
        assert page.text("error") == ""
        assert int(page.text("b-tokens")) < LONG_ANSWER
        assert painted_pixels(driver, "itl-chart") > 0  # the ITL strip chart has bars

        # the server saw the client leave: counted, aborted in the engine, its KV given back
        wait_for(lambda: counter(url, "firstlight_request_cancelled") == cancelled + 1)
        wait_for(lambda: counter(url, "firstlight_num_aborted") == aborted + 1)
        wait_for(lambda: (idle := idle_status(url)) and idle["kv_usage"] == baseline_kv)
        page.wait_for(lambda: page.text("svc-cancelled") == str(int(cancelled) + 1), timeout_s=10)
