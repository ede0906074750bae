"""The playground driven in headless Chromium: for its tests and `make screenshot`.

Uses the system's Chromium and its WebDriver (Debian: `chromium`, `chromium-driver`, which
`make setup` installs) through selenium with an explicit driver path, so nothing is ever
downloaded at run time. `find_chromium()` says what is missing, for a test to skip on.
`Playground` wraps one page: the element ids are the page's (`static/index.html`).
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
DRIVERS = ("chromedriver",)


@dataclass(slots=True, frozen=True)
class Chromium:
    browser: str
    driver: str


def find_chromium() -> Chromium | str:
    """The browser and driver found on PATH, or a sentence naming what is missing."""
    browser = next(filter(None, map(shutil.which, BROWSERS)), None)
    driver = next(filter(None, map(shutil.which, DRIVERS)), None)
    if browser and driver:
        return Chromium(browser, driver)
    missing = [name for name, path in (("chromium", browser), ("chromedriver", driver)) if not path]
    return (
        f"{' and '.join(missing)} not found on PATH "
        "(Debian: apt-get install chromium chromium-driver; `make setup` does it)"
    )


@contextlib.contextmanager
def headless_chromium(chromium: Chromium, width: int = 1280, height: int = 800) -> Iterator[Any]:
    """A selenium WebDriver on a fresh headless Chromium profile, quit on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium.browser
    for flag in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--disable-extensions",
        "--no-first-run",
        f"--window-size={width},{height}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=chromium.driver))
    try:
        yield driver
    finally:
        driver.quit()


class Playground:
    """One open playground page and what a person does on it."""

    def __init__(self, driver: Any, url: str) -> None:
        self.driver = driver
        driver.get(url.rstrip("/") + "/")
        self.wait_for(lambda: self.driver.find_element("id", "model").get_attribute("value"))

    def text(self, element_id: str) -> str:
        return self.driver.find_element("id", element_id).text

    def set(self, element_id: str, value: str) -> None:
        element = self.driver.find_element("id", element_id)
        element.clear()
        element.send_keys(value)

    def choose(self, element_id: str, value: str) -> None:
        from selenium.webdriver.support.select import Select

        Select(self.driver.find_element("id", element_id)).select_by_value(value)

    def tick(self, element_id: str, on: bool = True) -> None:
        box = self.driver.find_element("id", element_id)
        if box.is_selected() != on:
            box.click()

    def send(self, prompt: str) -> None:
        self.set("prompt", prompt)
        self.driver.find_element("id", "send").click()

    def stop(self) -> None:
        self.driver.find_element("id", "stop").click()

    def answers(self) -> list[str]:
        return [
            e.text for e in self.driver.find_elements("css selector", ".message.assistant .text")
        ]

    def last_answer(self) -> str:
        answers = self.answers()
        return answers[-1] if answers else ""

    def busy(self) -> bool:
        return self.driver.find_element("id", "stop").is_enabled()

    def wait_for(
        self, condition: Callable[[], Any], timeout_s: float = 30.0, poll_s: float = 0.01
    ) -> Any:
        """`condition()`'s first truthy value, polled every `poll_s`; TimeoutError after."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page did not reach {condition} in {timeout_s} s")
            time.sleep(poll_s)
