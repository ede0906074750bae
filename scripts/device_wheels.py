"""Fetch the wheels a lent GPU machine lacks for the Serve path, into `.whl/` (git-ignored).

    .venv/bin/python scripts/device_wheels.py        # here, with the package registry

The device machines (`/work/.library/device`) run Python 3.12 with torch, transformers,
triton, aiohttp, grpcio and the like installed, but no Ray, FastAPI or pydantic, and reach
no registry; what a call carries must fit 64 MiB with the working tree. Ray's own wheel is
79 MB, 32 of them the Java workers' jar, which nothing here runs: this script repacks it
without `ray/jars/` (its RECORD rewritten to match). Every other package is downloaded at the
version this checkout's virtual environment holds (so the device runs what CI tests), as a
CPython 3.12 x86-64 manylinux or pure-Python wheel. It prints the total, which must leave
room for the working tree.

On the device (`scripts/device_check.sh` does it): carry `.whl` and start with
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / ".whl"
LIMIT = 64 * 1024 * 1024  # what one device call carries, the working tree included

# What the Serve path imports and the device image lacks (its package list:
# /work/.library/device/KINDS.md), found by running Ray Serve on Python 3.12 with only
# those packages and these wheels installed.
PACKAGES = [
    "ray",
    "fastapi", "starlette", "uvicorn", "httptools", "websockets", "watchfiles",
    "python-dotenv", "python-multipart",
    "pydantic", "pydantic-core", "pydantic-settings", "annotated-types", "typing-inspection",
    "jsonschema", "jsonschema-specifications", "referencing", "rpds-py",
    "llguidance",
    # Ray's serve extra: the dashboard agent's metrics and the proxies
    "aiohttp-cors", "colorful", "mmh3", "smart-open", "grpcio-reflection",
    "opencensus", "opencensus-context", "google-api-core", "googleapis-common-protos",
    "proto-plus", "google-auth", "pyasn1", "pyasn1-modules",
    "opentelemetry-api", "opentelemetry-sdk", "opentelemetry-proto",
    "opentelemetry-exporter-prometheus", "opentelemetry-semantic-conventions",
    "pytest-asyncio",  # tests/gpu runs async tests
]  # fmt: skip
# The device's Python 3.12.3 is Ubuntu 24.04's (glibc 2.39): any manylinux up to 2_39.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
RAY_DROP = ("ray/jars/",)  # Java workers: nothing here starts one


def download(name: str, dest: Path) -> None:
    pin = f"{name}=={version(name)}"
    cmd = [
        sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
        "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3",
        "--abi", "none", *(f"--platform={p}" for p in PLATFORMS), "--platform=any",
        "-d", str(dest), pin,
    ]  # fmt: skip
    subprocess.run(cmd, check=True)


def repack_without(wheel: Path, drop: tuple[str, ...]) -> None:
    """Rewrite `wheel` in place without the files under `drop` (and their RECORD lines)."""
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename.startswith(drop):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(x for x in lines if not x.startswith(drop)).encode()
            dst.writestr(info, data)
    tmp.replace(wheel)


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir()
    with tempfile.TemporaryDirectory() as tmp:
        for name in PACKAGES:
            download(name, Path(tmp))
        for wheel in Path(tmp).glob("*.whl"):
            if wheel.name.startswith("ray-"):
                repack_without(wheel, RAY_DROP)
            shutil.move(wheel, OUT / wheel.name)
    wheels = sorted(OUT.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    tree = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    tree_bytes = sum((ROOT / p.decode()).stat().st_size for p in tree if p)
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {OUT.relative_to(ROOT)}/")
    print(f"with the working tree ({tree_bytes / 2**20:.1f} MiB): of {LIMIT / 2**20:.0f} MiB")
    if total + tree_bytes > LIMIT:
        raise SystemExit("too large to carry in one device call")


if __name__ == "__main__":
    main()
