"""A PNG of the playground mid-stream: `make screenshot` (docs/playground.png).

    python -m app.playground.screenshot [OUT.png] [--config serve_config.yaml]

Starts bare mode (`python -m app.standalone`, the demo model, a free loopback port) as a
child process, lets headless Chromium ask one short question to the end (so the service
panel has a TTFT to show), then asks a long one and takes the picture while it streams.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from app.playground.announce import wait_until_up
from app.playground.browser import Playground, find_chromium, headless_chromium

SIZE = (1280, 960)
STREAMED_CHARS = 500  # how much of the long answer is on the page when the picture is taken


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def bare_server(config: Path) -> Iterator[str]:
    """`app.standalone` on a free 127.0.0.1 port; yields its URL, stops it on exit."""
    port = free_port()
    command = [sys.executable, "-m", "app.standalone", "--host", "127.0.0.1", "--port", str(port)]
    if config.is_file():
        command += ["--config", str(config)]
    process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_until_up(url, timeout_s=300, while_pid=process.pid) or process.poll():
            raise SystemExit(f"bare mode did not come up at {url}")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def take(url: str, out: Path) -> None:
    chromium = find_chromium()
    if isinstance(chromium, str):
        raise SystemExit(chromium)
    with headless_chromium(chromium, *SIZE) as driver:
        page = Playground(driver, url)
        page.set("max-tokens", "48")
        page.send("Can I pause my annual subscription?")
        page.wait_for(lambda: not page.busy(), timeout_s=60)
        time.sleep(1.5)  # a status poll after it: the panel shows its TTFT
        page.set("max-tokens", "1500")
        page.tick("ignore-eos")
        page.send("How do I change the email address on my account?")
        page.wait_for(lambda: len(page.last_answer()) >= STREAMED_CHARS, timeout_s=60)
        out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(out))
        page.stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app.playground.screenshot")
    parser.add_argument("out", type=Path, nargs="?", default=Path("docs/playground.png"))
    parser.add_argument("--config", type=Path, default=Path("serve_config.yaml"))
    args = parser.parse_args(argv)
    with bare_server(args.config) as url:
        take(url, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
