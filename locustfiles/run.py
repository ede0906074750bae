"""`make load`: Locust headless against a firstlight server, then a report.

    python -m locustfiles.run        # settings from LOAD_* variables (locustfiles/settings.py)

1. The server: the one answering `LOAD_HOST`'s `/health` (default http://127.0.0.1:8000,
   e.g. `make serve` in another terminal). If none answers, bare mode (`python -m
   app.standalone --config serve_config.yaml`) is started on a free loopback port for the
   run and stopped after it; with `LOAD_START_SERVER=0` the run stops instead, saying how to
   start one.
2. `/metrics` is scraped, `/status` polled every `LOAD_SAMPLE_S` on a thread, and Locust runs
   `locustfiles/load.py` (every user, the step shape) in a child process, bounded by the
   shape's length plus a grace period; then `/metrics` is scraped again.
3. In the report folder (`LOAD_OUT`, default bench/out/load-<time>/): Locust's CSV files
   (`locust_stats.csv`, `locust_stats_history.csv`, `locust_failures.csv`, ...), its log,
   `requests.jsonl` (one `StreamRecord` per request), `status.jsonl` (the /status samples),
   `metrics_before.txt` / `metrics_after.txt`, `summary.json` and `report.html`; a started
   server's log is `server.log`. The summary is printed, and where the report is.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from locustfiles.analysis import RunInputs, analyze
from locustfiles.records import StreamRecord
from locustfiles.report import render_html, summary_lines
from locustfiles.server import StatusSampler, answers, bare_server, scrape
from locustfiles.settings import LoadSettings

ROOT = Path(__file__).resolve().parent.parent
LOCUSTFILE = ROOT / "locustfiles" / "load.py"
# Users leaving (a step down, the end) finish the stream they are reading first, so the only
# streams cut short are DropUser's; past this, Locust stops them anyway.
STOP_TIMEOUT_S = 30
GRACE_S = 60.0 + STOP_TIMEOUT_S  # past the shape's length before Locust is stopped


@contextlib.contextmanager
def target_server(settings: LoadSettings, out: Path) -> Iterator[str]:
    """The URL of the server to load: the running one, or bare mode started for the run."""
    if answers(settings.host):
        print(f"load: using the server at {settings.host}")
        yield settings.host
        return
    if not settings.start_server:
        raise SystemExit(
            f"load: no server answers {settings.host}/health. Start one in another terminal "
            "(`make serve`, or `make standalone` for bare mode) and run `make load` again, "
            "or set LOAD_HOST to its URL (loopback only)."
        )
    print(
        f"load: no server answers {settings.host}/health; starting bare mode "
        f"(python -m app.standalone --config {settings.config}) for this run"
    )
    with bare_server(ROOT / settings.config, out / "server.log", ROOT) as url:
        print(f"load: bare mode is up at {url} (log: {out / 'server.log'})")
        yield url
    print("load: bare mode stopped")


def run_locust(settings: LoadSettings, url: str, out: Path) -> int:
    """Locust headless in a child process; its return code (124 if it had to be stopped)."""
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", url,
        "--csv", str(out / "locust"), "--csv-full-history", "--only-summary",
        "--stop-timeout", str(STOP_TIMEOUT_S), "--loglevel", "WARNING",
    ]  # fmt: skip
    records = out / "requests.jsonl"
    records.unlink(missing_ok=True)  # the users append: a reused LOAD_OUT starts empty
    env = {**os.environ, "LOAD_RECORDS": str(records)}
    with (out / "locust.log").open("w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log)
        try:
            return process.wait(timeout=settings.duration_s() + GRACE_S)
        except subprocess.TimeoutExpired:
            return 124
        finally:  # also when the driver is interrupted
            if process.poll() is None:
                process.terminate()
                process.wait()


def read_records(path: Path) -> list[StreamRecord]:
    if not path.is_file():
        return []
    with path.open() as f:
        return [StreamRecord.from_json(line) for line in f if line.strip()]


def read_users(history_csv: Path) -> list[tuple[float, int]]:
    """(wall time, users) from Locust's `_stats_history.csv` (its "Aggregated" rows)."""
    if not history_csv.is_file():
        return []
    with history_csv.open(newline="") as f:
        return [
            (float(row["Timestamp"]), int(row["User Count"]))
            for row in csv.DictReader(f)
            if row["Name"] == "Aggregated"
        ]


def run(settings: LoadSettings, out: Path) -> Path:
    """One load run against the target server; returns the report's path."""
    out.mkdir(parents=True, exist_ok=True)
    steps = ",".join(map(str, settings.user_steps()))
    with target_server(settings, out) as url:
        print(
            f"load: {settings.duration_s():.0f} s, users {steps} (each {settings.step_s:g} s), "
            f"against {url}; writing {out}/"
        )
        before = scrape(url)
        sampler = StatusSampler(url, settings.sample_s).start()
        try:
            code = run_locust(settings, url, out)
        finally:
            samples = sampler.stop()
        ended = time.time()
        after = scrape(url)
    records = read_records(out / "requests.jsonl")
    if code != 0:
        print(f"load: locust exited with {code} (failed requests, or stopped); see "
              f"{out / 'locust.log'}")  # fmt: skip
    if not records:
        raise SystemExit(f"load: no request finished; see {out / 'locust.log'}")
    _write_raw(out, samples, before, after)
    inputs = RunInputs(
        records=records,
        start=min(r.start for r in records),  # the first user's first request
        end=ended,
        slos=settings.slos(),
        users=read_users(out / "locust_stats_history.csv"),
        status_samples=samples,
        metrics_before=before,
        metrics_after=after,
        window_s=settings.window_s,
    )
    summary = analyze(inputs)
    (out / "summary.json").write_text(json.dumps(dataclasses.asdict(summary), indent=1))
    report = out / "report.html"
    report.write_text(
        render_html(
            summary,
            title=f"firstlight load: {url}",
            settings={**settings.model_dump(), "target": url},
            stats_csv=out / "locust_stats.csv",
        )
    )
    print("\n".join(summary_lines(summary)))
    print(f"load: report {report.resolve()}")
    if not any(c.ok for c in summary.classes.values()):
        raise SystemExit("load: no request completed")
    return report


def _write_raw(
    out: Path, samples: list[tuple[float, dict]], before: str | None, after: str | None
) -> None:
    with (out / "status.jsonl").open("w") as f:
        for t, status in samples:
            f.write(json.dumps({"t": t, "status": status}) + "\n")
    for name, text in (("metrics_before.txt", before), ("metrics_after.txt", after)):
        if text is not None:
            (out / name).write_text(text)


def main(argv: Sequence[str] | None = None) -> None:
    if argv:
        raise SystemExit("usage: python -m locustfiles.run (settings: LOAD_* variables)")
    # SIGTERM ends the run as Ctrl-C does: through the `finally`s, which stop Locust and a
    # server started for the run
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    settings = LoadSettings()
    out = Path(settings.out or ROOT / "bench" / "out" / time.strftime("load-%Y%m%d-%H%M%S"))
    run(settings, out)


if __name__ == "__main__":
    main(sys.argv[1:])
