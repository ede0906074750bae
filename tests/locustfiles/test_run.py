"""`make load`'s driver without a server: what it reads back from Locust, and the message
when nothing answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from locustfiles.run import read_records, read_users, target_server
from locustfiles.server import free_port
from locustfiles.settings import LoadSettings
from tests.locustfiles.helpers import make_record

HISTORY = """Timestamp,User Count,Type,Name,Requests/s
1795517968,0,,Aggregated,0.0
1795517969,4,SSE,ttft[interactive],1.0
1795517969,4,,Aggregated,3.5
1795517970,8,,Aggregated,7.0
"""


def test_users_over_time_from_locust_history(tmp_path: Path) -> None:
    path = tmp_path / "locust_stats_history.csv"
    path.write_text(HISTORY)
    assert read_users(path) == [(1795517968, 0), (1795517969, 4), (1795517970, 8)]
    assert read_users(tmp_path / "missing.csv") == []


def test_records_read_back_line_by_line(tmp_path: Path) -> None:
    records = [make_record(at=1), make_record(at=2, tier="flex", outcome="dropped")]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(r.to_json() + "\n" for r in records) + "\n")
    assert read_records(path) == records


def test_no_server_and_no_start_says_how_to_start_one(tmp_path: Path) -> None:
    settings = LoadSettings(host=f"http://127.0.0.1:{free_port()}", start_server=False)
    with pytest.raises(SystemExit, match="make serve") as stop, target_server(settings, tmp_path):
        pass
    assert settings.host in str(stop.value)
