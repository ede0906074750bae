"""The OpenAI layer is shared with batch jobs: importing it must not pull in the web stack."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import importlib, pkgutil, sys
import app.openai
names = [m.name for m in pkgutil.iter_modules(app.openai.__path__, "app.openai.")]
for name in names:
    importlib.import_module(name)
web = sorted(m for m in sys.modules if m.split(".")[0] in ("starlette", "fastapi"))
print(len(names), web)
"""


def test_no_module_of_app_openai_imports_starlette_or_fastapi():
    out = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split(maxsplit=1)
    assert int(out[0]) >= 9  # body, chat, complete, errors, logprobs, prepare, prompts, ...
    assert out[1].strip() == "[]"
