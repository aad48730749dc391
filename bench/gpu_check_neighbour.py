"""GPU check of the ``other_process`` cause: NVML's per-process SM use, read for real.

    python bench/gpu_check_neighbour.py        # part 6 of bench/gpu_check.sh

Starts a neighbour, a process that is not a descendant of this one (a shell starts it and exits,
so it is re-parented), looping matmuls on cuda:0, and samples device 0 through infersight's Nvml
for a few seconds. It checks what the fake NVML of the tests only stands in for:

- ``nvmlDeviceGetProcessUtilization`` answers on this GPU (``process_util_read``), with the
  neighbour's PID (NVML's host PID mapped to ours) and an SM share above 0;
- its uid is ours and its parent chain does not hold this process: judged for a series whose
  requests ran here (own = this PID), it is *other*, and the window shows ``other_process``;
- judged for the neighbour's own series (own = its PID), it is not.

Prints the samples' figures and one JSON verdict line; exit status 0 when every check held.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NEIGHBOUR = """
import os, sys, time, torch
x = torch.randn(8192, 8192, device="cuda:0")
open(sys.argv[1], "w").write(str(os.getpid()))
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    x @ x
    torch.cuda.synchronize()
"""


def start_neighbour(seconds: float, d: Path) -> int:
    """The neighbour's PID: started by a shell that exits at once, so init (or a subreaper) adopts it."""
    script, ready, log = d / "neighbour.py", d / "ready", d / "neighbour.log"
    script.write_text(NEIGHBOUR)
    out = subprocess.run(["sh", "-c", f'"{sys.executable}" "{script}" "{ready}" {seconds} >"{log}" 2>&1 & echo $!'],
                         check=True, capture_output=True, text=True)
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if ready.exists() and ready.read_text().strip():
            return pid
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise SystemExit(f"gpu_check_neighbour: the neighbour exited before computing on cuda:0:\n"
                             f"{log.read_text()[-2000:]}") from None
        time.sleep(0.2)
    try:  # (it would compute on cuda:0 through the next checks)
        os.kill(pid, 9)
    except ProcessLookupError:
        pass
    raise SystemExit("gpu_check_neighbour: the neighbour did not start on cuda:0 in 120 s")


def main() -> int:
    from infersight.agent.devices.heterogeneity import summarize_samples
    from infersight.agent.devices.nvml import Nvml
    from infersight.rules.device_rules import load_device_rules

    th = load_device_rules().thresholds
    work = Path(tempfile.mkdtemp(prefix="infersight-neighbour-"))
    try:
        neighbour = start_neighbour(40, work)
    except SystemExit:
        shutil.rmtree(work, ignore_errors=True)
        raise
    nv = Nvml()
    st = nv.status()
    assert st.available, st.reason
    samples = []
    try:
        time.sleep(3)  # its kernels are running
        for _ in range(8):
            s = next(x for x in nv.sample_all() if x.index == 0)
            samples.append(s)
            for g in s.processes or ():
                print(f"  t={s.time_ns / 1e9:.1f} util={s.utilization_gpu_pct}% pid={g.pid} host_pid={g.host_pid} "
                      f"sm={g.sm_pct}% uid={g.uid} ancestors={g.ancestors} read={s.process_util_read}")
            time.sleep(1)
    finally:
        try:
            os.kill(neighbour, 15)
        except ProcessLookupError:
            pass
        shutil.rmtree(work, ignore_errors=True)
    ok = True
    read = [s for s in samples if s.process_util_read]
    mine = [g for s in read for g in s.processes or () if g.pid == neighbour]
    unmapped = {str(g.unmapped_reason) for s in samples for g in s.processes or () if g.pid is None}
    if not mine and unmapped:  # (a nested PID namespace: NVML's host PIDs are not ours) say why, not "no SM use"
        print(f"FAIL: the neighbour was not found among the mapped GPU processes; unmapped: {sorted(unmapped)}")
        ok = False
    if not read:
        print("FAIL: per-process utilisation was not read on this GPU (process_util_read False in every sample)")
        ok = False
    elif not any((g.sm_pct or 0) > 0 for g in mine):
        print(f"FAIL: no sample gave the neighbour (pid {neighbour}) SM use above 0")
        ok = False
    if mine and not all(g.uid == os.getuid() and g.ancestors is not None and os.getpid() not in g.ancestors
                        for g in mine if g.ancestors is not None):
        print("FAIL: the neighbour's uid or parents are not as started")
        ok = False
    as_server = summarize_samples(samples, th, frozenset({os.getpid()}))
    as_itself = summarize_samples(samples, th, frozenset({neighbour}))
    print(json.dumps({"busy_samples": as_server.busy_samples, "other_process_samples": as_server.other_process_samples,
                      "other_detail": as_server.other_detail,
                      "own_series_other_samples": as_itself.other_process_samples}))
    if as_server.other_process_samples == 0:
        print("FAIL: the window of a series served here shows no other-process samples")
        ok = False
    if as_itself.other_process_samples != 0:
        print("FAIL: the neighbour's own series calls it another process")
        ok = False
    print("gpu_check_neighbour:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
