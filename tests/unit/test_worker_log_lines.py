"""Every worker's own log lines reach the serve log under its own prefix. Ray's driver
folds lines that differ only in numbers, from several processes within 5 s, into one
"[repeated Nx across cluster]" line under the last speaker: two workers' start-up lines
("weights loaded in 1.2 s; 181 KV blocks") came out as one, and a worker's line went
missing from the log. `quiet_ray` exempts tandem's lines; Ray's own are still folded.
Run in a fresh interpreter: Ray reads the setting when it is imported."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

SCRIPT = r"""
import json, logging, sys
from cli.serve import quiet_ray
from worker_runtime.config import LOG_FORMAT

quiet_ray()
from ray._private.ray_logging import stdout_deduplicator as dedup  # the driver's own

fmt = logging.Formatter(LOG_FORMAT)

def line(name, msg):
    return fmt.format(logging.LogRecord(name, logging.INFO, "", 0, msg, (), None))

printed = []
for pid, actor in ((101, "decode-0"), (102, "prefill-0")):
    batch = {"ip": "127.0.0.1", "pid": pid, "actor_name": actor, "task_name": None, "is_err": False,
             "job": "01000000", "lines": [
                 line("engine.build", f"engine: /m (bfloat16) weights loaded in 1.{pid} s; {pid} KV blocks"),
                 line("ray.some_module", f"Ray says {pid} things"),
             ]}
    for out in dedup.deduplicate(batch):
        printed += [(out["pid"], l) for l in out["lines"]]
print(json.dumps(printed))
"""


def _printed(**env: str) -> list[tuple[int, str]]:
    """(pid, line) of what the driver prints for SCRIPT's lines, with `env` on top of
    this environment less any RAY_DEDUP setting."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_DEDUP")}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env={**base, **env},
                         timeout=120, check=True).stdout
    return [tuple(p) for p in json.loads(out.strip().splitlines()[-1])]


def test_each_workers_start_up_line_is_kept_and_rays_own_lines_still_fold():
    printed = _printed()
    loaded = [pid for pid, text in printed if "weights loaded" in text]
    assert loaded == [101, 102], printed  # each worker's line, under its own pid
    assert [pid for pid, text in printed if "Ray says" in text] == [101], printed  # the second is held to fold


def test_a_users_own_setting_is_kept():
    printed = _printed(RAY_DEDUP_LOGS_ALLOW_REGEX="nothing-matches-this")
    assert [pid for pid, text in printed if "weights loaded" in text] == [101], printed
