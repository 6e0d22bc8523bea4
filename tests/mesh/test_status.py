"""`chatmesh status`'s arithmetic and the scrape config kept in the repo."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from chatmesh.mesh import status
from chatmesh.mesh.config import Config


def test_quantile_interpolates_inside_the_bucket_like_prometheus() -> None:
    # 10 observations: 4 <= 0.1, 9 <= 0.2, 10 <= +Inf -> p50 rank 5 lies in (0.1, 0.2]: 0.1 + 0.1 * 1/5
    buckets = {0.1: 4.0, 0.2: 9.0, math.inf: 10.0}
    assert status.quantile(0.5, buckets) == pytest.approx(0.12)
    assert status.quantile(0.95, buckets) == 0.2  # in the +Inf bucket: the highest finite bound
    assert status.quantile(0.2, buckets) == pytest.approx(0.05)
    assert math.isnan(status.quantile(0.5, {0.1: 0.0, math.inf: 0.0}))


def test_the_repos_scrape_config_is_what_chatmesh_status_prints_for_the_defaults() -> None:
    repo = Path(__file__).parents[2] / "docs/observability/prometheus.yml"
    assert repo.read_text() == status.scrape_config(Config(env={}))
    text = status.scrape_config(Config(env={"CHATMESH_STORE_METRICS_PORT": "0", "CHATMESH_CHAT_METRICS_PORT": "7001",
                                            "CHATMESH_CHAT_ADDRESS": "10.1.2.3:50051"}), interval_s=0.5)
    assert "chatmesh-store" not in text and "targets: ['10.1.2.3:7001']" in text and "scrape_interval: 500ms" in text


def test_status_without_certificates_says_what_is_missing_without_a_traceback(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "chatmesh.mesh.cli", "status", "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "mutual TLS needs" in done.stderr and "chatmesh certs" in done.stderr
