"""The live context of engine memory errors, end to end (rules/serving_context.py).

A real hooked Python process runs a STAND-IN for a vLLM server (``fake_vllm_server.py``,
written below: no vLLM, no GPU) with vLLM's command line, and logs real vLLM messages
through ``logging``; a real agent (in-process, real socket, real file exporter) classifies
them. NVML is a FAKE (this machine has no GPU): ``FakeNvml`` returns the devices feature's
real ``DeviceSample`` values, listing the stand-in's real pid and a real second process
(``sleep``, another process tree) as the device's tenants. A second test runs the stand-in
under ``infersight launch`` on this machine, where NVML is absent: the knobs of the command
line still reach the record.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from conftest import BOOTSTRAP, attr, hook_env, log_records, read_otlp_lines

from infersight.agent.commands.compose import build_exporters
from infersight.agent.daemon import config as cfg
from infersight.agent.daemon.lifecycle import Agent
from infersight.agent.devices.nvml import DeviceSample, GpuProcess
from infersight.agent.oom.extension import OomExtension

SUPPORT = Path(__file__).resolve().parents[1] / "support"
DATA = SUPPORT / "data"
GIB = 1 << 30


def _record(name: str, rid: str) -> str:
    for line in (DATA / name).read_text(encoding="utf-8").splitlines():
        d = json.loads(line)
        if d["id"] == rid:
            return str(d["message"])
    raise KeyError(rid)


# srv-012 (given; vllm-project/vllm#10439): "No available memory for the cache blocks": the text
# decides reservation_conflict. c5-006 (vllm-project/vllm, collected): a CUDA driver OOM while
# vLLM repacked its weights: the text does not decide (unknown).
GIVEN = _record("serving_ooms_given.jsonl", "srv-012")
UNDECIDED = _record("serving_ooms_collected5.jsonl", "c5-006")

# A STAND-IN for a vLLM server: vLLM's command line, vLLM's logger name, real vLLM message texts.
STAND_IN = '''"""STAND-IN for a vLLM OpenAI server (test only): logs the messages it is given, then waits."""
import json, logging, sys
logging.basicConfig(level=logging.INFO)
log = logging.getLogger("vllm.engine.llm_engine")
for msg in json.loads(open(sys.argv[1]).read()):
    log.error(msg)
print("logged", flush=True)
sys.stdin.readline()   # alive until the test has its records (the agent reads /proc/<pid>/cmdline)
'''
ARGV = ["--model", "/models/secret-model-name", "--gpu-memory-utilization", "0.95", "--max_model_len=8192",
        "--enforce-eager", "--api-key", "sk-do-not-send"]


class FakeNvml:
    """FAKE NVML (no GPU here): one 80 GiB device whose process list the test fills in once
    the processes exist (real DeviceSample values)."""

    def __init__(self) -> None:
        self.procs: list[tuple[int, int]] = []
        self.samples = 0

    def device_count(self) -> int:
        return 1

    def sample(self, index: int) -> DeviceSample | None:
        self.samples += 1
        return DeviceSample(time_ns=time.time_ns(), index=index, uuid="GPU-fa4e0000-0000-4000-8000-000000000000",
                            name="FAKE GPU", memory_total_bytes=80 * GIB,
                            processes=tuple(GpuProcess(pid, used, pid, "python") for pid, used in self.procs))


def _stand_in(tmp_path: Path, messages: list[str]) -> tuple[Path, Path]:
    script = tmp_path / "fake_vllm_server.py"
    script.write_text(STAND_IN, encoding="utf-8")
    msgs = tmp_path / "messages.json"
    msgs.write_text(json.dumps(messages), encoding="utf-8")
    return script, msgs


async def test_live_context_decides_an_undecided_vllm_oom_and_keeps_a_decided_one(tmp_path: Path) -> None:
    out = tmp_path / "out.otlp.jsonl"
    sock, spool = tmp_path / "a.sock", tmp_path / "spool"
    conf = cfg.load(None, env={}, flags={"agent.socket": str(sock), "agent.spool_dir": str(spool),
                                         "exporters.file.path": str(out), "rules.dirs": [],
                                         "agent.health_interval_s": 3600.0})
    nvml = FakeNvml()
    oom = OomExtension(conf, nvml=nvml)
    agent = Agent(conf, build_exporters(conf, env={}), [oom], embedded=True)
    await agent.start()
    script, msgs = _stand_in(tmp_path, [UNDECIDED, GIVEN, UNDECIDED])  # the repeat: once
    tenant = subprocess.Popen(["sleep", "300"])  # another process tree on the device
    env = hook_env(sock, spool, PYTHONPATH=os.pathsep.join([str(BOOTSTRAP), str(SUPPORT)]))
    proc = await asyncio.create_subprocess_exec(sys.executable, str(script), str(msgs), *ARGV, env=env,
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    nvml.procs = [(proc.pid, 60 * GIB), (tenant.pid, 16 * GIB)]
    recs: list[dict[str, Any]] = []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert (await asyncio.wait_for(proc.stdout.readline(), 30)).strip() == b"logged"

        async def arrived() -> bool:
            for _ in range(300):
                recs[:] = [r for r in log_records(read_otlp_lines(out)) if r.get("eventName") == "oom"] \
                    if out.exists() else []
                if len(recs) >= 2:
                    return True
                await asyncio.sleep(0.05)
            return False

        assert await arrived(), recs
        proc.stdin.write(b"\n")
        await proc.stdin.drain()
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err
        await agent.ingest.wait_connections_closed(10)
    finally:
        if proc.returncode is None:
            proc.kill()
        tenant.kill()
        tenant.wait(10)
        await agent.shutdown(10)
    recs = [r for r in log_records(read_otlp_lines(out)) if r.get("eventName") == "oom"]
    by_rule = {str(attr(r, "infersight.oom.rule")): r for r in recs}
    assert len(recs) == 2, [attr(r, "infersight.oom.rule") for r in recs]  # the repeated text: once
    decided = by_rule["gpu.cuda-runtime-oom/vllm-loading-weights+context.other-process"]
    assert attr(decided, "infersight.oom.class") == "reservation_conflict"
    assert attr(decided, "infersight.oom.context_decided") is True
    assert attr(decided, "infersight.oom.engine") == "vllm"
    reason = str(attr(decided, "infersight.oom.reason"))
    assert "pid %d python (16.00 GiB)" % tenant.pid in reason
    assert "this engine's processes 60.00 GiB of the 80.00 GiB device" in reason
    remedy = str(attr(decided, "infersight.oom.remedy"))
    assert "Move or stop pid %d" % tenant.pid in remedy and "--gpu-memory-utilization 0.95" in remedy
    pids = attr(decided, "infersight.oom.context.other_pids")["values"]  # an OTLP arrayValue
    assert [int(next(iter(v.values()))) for v in pids] == [tenant.pid]
    assert int(attr(decided, "infersight.oom.context.other_bytes")) == 16 * GIB
    assert int(attr(decided, "infersight.oom.context.total_bytes")) == 80 * GIB
    assert attr(decided, "infersight.oom.context.knob.gpu_memory_utilization") == 0.95
    assert int(attr(decided, "infersight.oom.context.knob.max_model_len")) == 8192
    assert attr(decided, "infersight.oom.context.knob.enforce_eager") is True
    assert int(attr(decided, "infersight.oom.context.pid")) == proc.pid
    kept = by_rule["vllm.kv.no-cache-blocks"]  # the given message decided its class: kept
    assert attr(kept, "infersight.oom.class") == "reservation_conflict"
    assert attr(kept, "infersight.oom.context_decided") is False
    note = str(attr(kept, "infersight.oom.note"))
    assert "live context: NVML at the error" in note and "--gpu-memory-utilization 0.95" in note
    for r in recs:  # nothing of the command line but the knobs leaves the agent
        text = json.dumps(r)
        assert "sk-do-not-send" not in text and "secret-model-name" not in text
    assert oom.handlers.context_decided == 1
    assert nvml.samples == 2  # one NVML read per distinct message


CLI = [sys.executable, "-m", "infersight"]


def test_launch_without_nvml_puts_the_command_lines_knobs_on_the_record(tmp_path: Path) -> None:
    script, msgs = _stand_in(tmp_path, [GIVEN])
    out = tmp_path / "run.otlp.jsonl"
    env = dict(os.environ)
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    r = subprocess.run([*CLI, "launch", "--no-console", "--otlp-file", str(out), "--", sys.executable,
                        str(script), str(msgs), *ARGV], input="\n", capture_output=True, text=True, timeout=120,
                       env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert out.exists()
    (rec,) = [x for x in log_records(read_otlp_lines(out)) if x.get("eventName") == "oom"]
    assert attr(rec, "infersight.oom.class") == "reservation_conflict"
    assert attr(rec, "infersight.oom.rule") == "vllm.kv.no-cache-blocks"
    assert attr(rec, "infersight.oom.context_decided") is False
    assert attr(rec, "infersight.oom.context.knob.gpu_memory_utilization") == 0.95
    assert int(attr(rec, "infersight.oom.context.knob.max_model_len")) == 8192
    note = str(attr(rec, "infersight.oom.note"))
    assert "command line: --enforce-eager --gpu-memory-utilization 0.95 --max-model-len 8192" in note
    assert "NVML at the error" not in note  # no NVML here (or, with one, no GPU memory of the stand-in)
    assert "sk-do-not-send" not in json.dumps(rec)
