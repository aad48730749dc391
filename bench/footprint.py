"""Agent footprint: idle CPU and resident memory of a real ``infersight agent`` after 60 s.

Starts the daemon with the file exporter and the default health interval, leaves it idle,
and reads its CPU time and RSS from /proc. Run: python bench/footprint.py [seconds]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def proc_cpu_s(pid: int) -> float:
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
    d = tempfile.mkdtemp()
    conf = os.path.join(d, "a.toml")
    with open(conf, "w") as f:
        f.write('[agent]\nsocket = "%s/a.sock"\nspool_dir = "%s/spool"\nstate_dir = "%s/state"\n'
                '[exporters.file]\npath = "%s/o.jsonl"\n' % (d, d, d, d))
    p = subprocess.Popen([sys.executable, "-m", "infersight", "agent", "--config", conf],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not os.path.exists(os.path.join(d, "a.sock")):
            time.sleep(0.05)
        time.sleep(2.0)  # past start-up
        c0, t0 = proc_cpu_s(p.pid), time.monotonic()
        time.sleep(seconds)
        c1, t1 = proc_cpu_s(p.pid), time.monotonic()
        print(json.dumps({
            "idle_seconds": round(t1 - t0, 1),
            "idle_cpu_percent_of_core": round(100 * (c1 - c0) / (t1 - t0), 3),
            "rss_mib": round(rss_bytes(p.pid) / 2**20, 1),
            "goal_idle_cpu_percent": 1.0,
        }))
    finally:
        p.terminate()
        p.wait(20)


if __name__ == "__main__":
    main()
