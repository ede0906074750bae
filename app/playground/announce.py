"""Print where a person opens the playground, once the app answers: `make serve`'s last line.

    python -m app.playground.announce [--config serve_config.yaml] [--while-pid PID]
                                      [--timeout-s 900]

Runs beside `serve run` (which never returns): it reads the HTTP host and port from the same
config, waits until `/health` answers, and prints the page's URL and the API's base URL. With
`--while-pid` it gives up silently as soon as that process (`serve run`) has exited.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from app.settings import SERVE_DEFAULT_PORT
from app.standalone import DEFAULT_CONFIG, read_serve_config


def base_url(config: Path) -> str:
    options = read_serve_config(config) if config.is_file() else {}
    host = options.get("host", "127.0.0.1")
    if host in ("0.0.0.0", "::"):  # listening everywhere: this machine reaches it on loopback
        host = "127.0.0.1"
    return f"http://{host}:{options.get('port', SERVE_DEFAULT_PORT)}"


def alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def wait_until_up(url: str, timeout_s: float, while_pid: int | None = None) -> bool | None:
    """True once `/health` answers 200 (polled every 0.2 s); False after `timeout_s`; None if
    `while_pid` left."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(while_pid):
            return None
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app.playground.announce")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--while-pid", type=int, help="give up once this process has exited")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    args = parser.parse_args(argv)
    url = base_url(args.config)
    up = wait_until_up(url, args.timeout_s, args.while_pid)
    if up:
        print(f"\nfirstlight is up: open {url}/ for the playground (OpenAI API: {url}/v1)\n")
    elif up is False:
        print(f"\nfirstlight: {url}/health did not answer within {args.timeout_s:.0f} s\n")


if __name__ == "__main__":
    main()
