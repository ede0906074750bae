"""`make serve`'s last line: the announcer prints the playground's URL once the app answers,
and leaves quietly when `serve run` exits before that."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from app.playground.announce import base_url, main, wait_until_up
from tests.app.helpers import live_server, make_app

CONFIG = """
http_options: {{host: {host}, port: {port}}}
applications:
  - name: firstlight
    import_path: actors.builder:build_app
    args: {{}}
"""


async def test_prints_the_page_url_once_the_app_answers(tmp_path, capsys) -> None:
    app, _ = make_app()
    async with live_server(app) as url:
        port = url.rsplit(":", 1)[1]
        config = tmp_path / "serve.yaml"
        config.write_text(CONFIG.format(host="0.0.0.0", port=port))
        assert base_url(config) == url  # listening everywhere: announced on loopback
        await asyncio.to_thread(main, ["--config", str(config), "--timeout-s", "10"])
    assert f"open {url}/ for the playground" in capsys.readouterr().out


def test_gives_up_silently_once_serve_run_has_exited() -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    assert wait_until_up("http://127.0.0.1:9", timeout_s=30, while_pid=process.pid) is None
