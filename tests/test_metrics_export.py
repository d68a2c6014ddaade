"""The run's gauges on a real Ray metrics endpoint for as long as the run lasts, and not after.

Ray's metrics agent forgets a gauge 2 export intervals after its last `set` (CI once scraped a
3-step run under load and never saw `ray_meshpipe_restarts`, set once at the start). The check
runs in a child process with its own embedded Ray, because the export interval
(`RAY_metrics_report_interval_ms`, 1 s here) is read when Ray starts.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, time
import ray
from orchestrator.driver.metrics import RunMetrics, local_endpoint, exported_value
from orchestrator.driver.placement import loopback_only

with loopback_only():
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR")
url = local_endpoint()
m = RunMetrics("keep-demo", 0.25, restarts=3)
seen = []                      # (seconds since the metrics were made, restarts as scraped)
t0 = time.monotonic()
while time.monotonic() - t0 < 6.0:           # 6 intervals: 3 times the agent's memory of a set
    seen.append((round(time.monotonic() - t0, 2), exported_value(url, "ray_meshpipe_restarts", {"run": "keep-demo"})))
    time.sleep(0.5)
m.close()
closed = time.monotonic()
after = None
while time.monotonic() - closed < 8.0:       # after close: gone within 2 intervals (+ an export)
    after = exported_value(url, "ray_meshpipe_restarts", {"run": "keep-demo"})
    if after is None:
        break
    time.sleep(0.5)
print(json.dumps({"seen": seen, "after_close": after, "gone_after_s": round(time.monotonic() - closed, 2)}))
ray.shutdown()
"""


def test_a_gauge_set_once_stays_on_the_endpoint_while_the_run_lasts_and_ages_out_after():
    env = {**os.environ, "RAY_metrics_report_interval_ms": "1000", "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    r = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # once the first export has landed (within ~1 interval), every later scrape shows the value
    first = next(i for i, (_, v) in enumerate(out["seen"]) if v is not None)
    later = out["seen"][first:]
    assert out["seen"][first][0] < 3.0, out
    assert [v for _, v in later] == [3.0] * len(later), out
    assert later[-1][0] - later[0][0] >= 3.0, out          # well past the 2 s a single set lives
    assert out["after_close"] is None, out                   # the keeper stopped: it aged out
