"""Live classification of serving engines' memory errors (issue 24, point 6).

Real hooked child processes (the bootstrap on PYTHONPATH, no torch, no GPU): one logs a real
vLLM message through ``logging`` (twice, and from a second process), one dies of an uncaught
SGLang error, one logs a non-memory error; a real agent with the real file exporter
classifies them, and the test reads the OTLP file.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from conftest import BOOTSTRAP, attr, hook_env, log_records, read_otlp_lines

from infersight.agent.commands.compose import build_exporters
from infersight.agent.daemon import config as cfg
from infersight.agent.daemon.lifecycle import Agent
from infersight.agent.oom.extension import OomExtension
from infersight.hooks import _enginelog
from infersight.rules import serving

TESTS = Path(__file__).resolve().parent
GIVEN = TESTS / "data" / "serving_ooms_given.jsonl"


def _given(rid: str) -> str:
    for line in GIVEN.read_text(encoding="utf-8").splitlines():
        d = json.loads(line)
        if d["id"] == rid:
            return str(d["message"])
    raise KeyError(rid)


CHILD_LOGS = """
import json, logging, sys
logging.basicConfig(level=logging.INFO)
log = logging.getLogger("vllm.engine")
log.info("Loading model weights took 14.99 GiB memory")   # INFO: never sent
log.warning("this is a warning without the needles")
msg = json.loads(sys.argv[1])
log.error(msg)
log.error(msg)      # the same message again: once
log.error("AssertionError: max_num_batched_tokens (2048) is smaller than max_model_len (8192); memory")
"""

CHILD_RAISES = """
import json, sys
raise RuntimeError(json.loads(sys.argv[1]))
"""


async def _child(code: str, arg: str, sock: Path, spool: Path) -> tuple[int, str]:
    env = hook_env(sock, spool, PYTHONPATH=os.pathsep.join([str(BOOTSTRAP), str(TESTS)]),
                   INFERSIGHT_MEM_INTERVAL_S="0")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, arg, env=env,
                                                stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode or 0, err.decode()


async def test_logged_and_raised_engine_errors_are_classified_once(tmp_path: Path) -> None:
    out = tmp_path / "out.otlp.jsonl"
    sock, spool = tmp_path / "a.sock", tmp_path / "spool"
    conf = cfg.load(None, env={}, flags={"agent.socket": str(sock), "agent.spool_dir": str(spool),
                                         "exporters.file.path": str(out), "rules.dirs": [],
                                         "agent.health_interval_s": 3600.0})
    oom = OomExtension(conf)
    agent = Agent(conf, build_exporters(conf, env={}), [oom], embedded=True)
    await agent.start()
    vllm_msg = _given("srv-025")
    try:
        rc, err = await _child(CHILD_LOGS, json.dumps(vllm_msg), sock, spool)
        assert rc == 0, err
        assert vllm_msg in err  # the user's own log output is untouched
        rc, err = await _child(CHILD_LOGS, json.dumps(vllm_msg), sock, spool)  # a second process
        assert rc == 0, err
        rc, err = await _child(CHILD_RAISES, json.dumps(
            "Not enough memory. Please try to increase --mem-fraction-static."), sock, spool)
        assert rc == 1 and "mem-fraction-static" in err
        await agent.ingest.wait_connections_closed(10)
    finally:
        await agent.shutdown(10)
    recs = [r for r in log_records(read_otlp_lines(out)) if r.get("eventName") == "oom"]
    by_engine: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        by_engine.setdefault(str(attr(r, "infersight.oom.engine")), []).append(r)
    assert sorted(by_engine) == ["sglang", "vllm"]
    (v,) = by_engine["vllm"]  # logged twice by two processes: classified once
    assert attr(v, "infersight.oom.class") == "reservation_conflict"
    assert attr(v, "infersight.oom.rule") == "vllm.startup.free-below-utilization"
    assert attr(v, "infersight.oom.source") == "log"
    assert attr(v, "infersight.oom.knob") == "gpu_memory_utilization"
    assert int(attr(v, "infersight.oom.T_bytes")) == round(79.32 * (1 << 30))
    (s,) = by_engine["sglang"]
    assert attr(s, "infersight.oom.class") == "reservation_conflict"
    assert attr(s, "infersight.oom.source") == "exception"
    assert oom.handlers.duplicates == 1
    assert oom.handlers.not_memory == 2  # the assertion line, once per process: sent, dropped


def test_hook_needles_match_the_rules() -> None:
    assert _enginelog.NEEDLES == serving.NEEDLES
    for rule in serving.builtin().rules:
        for ex in rule.examples:
            if ex.kind == "positive":
                assert _enginelog.interesting(ex.text), (rule.id, ex.text[:60])


def test_records_below_warning_are_not_even_formatted() -> None:
    class Loud:
        def __str__(self) -> str:
            raise AssertionError("an INFO record was formatted by the hook")

    saved = logging.Logger.callHandlers
    try:
        _enginelog.install_logging(logging)
        _enginelog.install_logging(logging)  # idempotent
        log = logging.getLogger("infersight-test-enginelog")
        log.propagate = False
        log.setLevel(logging.DEBUG)
        log.info("%s", Loud())  # no handler formats it, and neither does the hook
    finally:
        logging.Logger.callHandlers = saved
