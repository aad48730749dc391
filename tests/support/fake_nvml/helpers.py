"""Build the FAKE libnvidia-ml.so.1 (fake_nvml.c) and run code against it in a subprocess.

nvidia-ml-py loads the library with ``CDLL("libnvidia-ml.so.1")`` at ``nvmlInit`` and keeps it
for the life of the process, so every scenario runs in a fresh interpreter whose
``LD_LIBRARY_PATH`` starts with the fake's directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
FAKE_SRC = HERE / "fake_nvml.c"
DRIVER = HERE / "driver.py"
INIT_PIDNS = "pid:[4026531836]"


def build_fake_nvml(dest: Path, pre_r535: bool = False) -> Path:
    """Compile the fake into ``dest/libnvidia-ml.so.1``; returns ``dest``. ``pre_r535``: as a
    driver before R535, whose library has the clock-event reasons under their older name only."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc) to build the fake NVML library")
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / "libnvidia-ml.so.1"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", *(["-DFAKE_NVML_PRE_R535"] if pre_r535 else []),
         "-o", str(out), str(FAKE_SRC)],
        check=True,
        capture_output=True,
        text=True,
    )
    return dest


def make_proc_root(root: Path, procs: dict[int, str], host_pidns: bool = True,
                   parents: dict[int, int] | None = None, uids: dict[int, int] | None = None) -> Path:
    """A FAKE /proc: ``self/ns/pid`` (init namespace or not) and ``<pid>/comm`` per process; with
    ``parents`` (pid -> parent pid) a ``<pid>/stat`` too, and with ``uids`` a ``<pid>/status``."""
    (root / "self" / "ns").mkdir(parents=True, exist_ok=True)
    link = root / "self" / "ns" / "pid"
    if link.is_symlink():
        link.unlink()
    link.symlink_to(INIT_PIDNS if host_pidns else "pid:[4026532999]")
    for pid, comm in procs.items():
        add_fake_process(root, pid, comm, (parents or {}).get(pid), (uids or {}).get(pid))
    return root


def add_fake_process(root: Path, pid: int, comm: str, parent: int | None = None, uid: int | None = None,
                     start_ticks: int = 4711) -> None:
    """One process of a FAKE /proc: ``comm``; ``stat`` (state, parent, start ticks) when ``parent`` is
    given; ``status`` (its ``Uid:`` line) when ``uid`` is. ``stat`` goes last: a reader that finds it
    finds the rest."""
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "comm").write_text(comm + "\n")
    if uid is not None:
        (d / "status").write_text(f"Name:\t{comm}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    if parent is not None:
        rest = " ".join(["0"] * 17)  # pgrp .. itrealvalue
        tmp = d / "stat.tmp"
        tmp.write_text(f"{pid} ({comm}) S {parent} {rest} {start_ticks} 0 0\n")
        tmp.replace(d / "stat")


def fake_env(libdir: Path | None, config: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if libdir is None:
        env.pop("LD_LIBRARY_PATH", None)
    else:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(libdir)] + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
        )
    if config is not None:
        env["FAKE_NVML_CONFIG"] = str(config)
    return env


def run_driver(libdir: Path | None, config_text: str, tmp: Path, *args: str) -> dict[str, Any]:
    """Run driver.py against the fake with ``config_text``; returns its JSON report."""
    cfg = tmp / "fake_nvml.cfg"
    cfg.write_text(config_text)
    proc = subprocess.run(
        [sys.executable, str(DRIVER), *args],
        env=fake_env(libdir, cfg),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        raise AssertionError(f"driver failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    report["stderr"] = proc.stderr
    return report
