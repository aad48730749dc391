"""The hook's drain thread: batches with a deadline, bursts spilled to the spool, not dropped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import attr, hook_env, log_records, read_otlp_lines


def indices(lines: list[dict]) -> list[int]:  # type: ignore[type-arg]
    return [int(attr(r, "i")) for r in log_records(lines) if attr(r, "i") is not None]


def run_hooked(tmp_path: Path, agent, code: str, **env: str) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    script = tmp_path / "w.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], env=hook_env(agent.sock, agent.spool, **env),
                          capture_output=True, text=True, timeout=120)


def test_a_quiet_process_sends_few_frames(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    """100 events, 5 ms apart: with a 1 s deadline they share a few frames, not one each."""
    agent = agent_factory().start()
    code = (
        "import time\nfrom infersight import hooks\nfrom infersight.hooks import _runtime\n"
        "c = _runtime.state().client\nassert c.batch_delay_s == 1.0 and c.batch_events == 512\n"
        "for i in range(100):\n    hooks.log('e', i=i)\n    time.sleep(0.005)\n"
        "assert hooks.flush(30)\nprint(c.sent_frames, c.sent_events)\n"
    )
    # No cold-start sampler: its checkpoints go out every 100 ms, whatever the batch delay.
    r = run_hooked(tmp_path, agent, code, INFERSIGHT_BATCH_DELAY_MS="1000", INFERSIGHT_SAMPLER="0")
    assert r.returncode == 0, r.stderr
    frames, events = map(int, r.stdout.split())
    assert events >= 100
    assert frames <= 10, "%d frames for %d events: not batched" % (frames, events)
    assert agent.stop() == 0
    assert sorted(indices(read_otlp_lines(agent.out))) == list(range(100))


def test_full_batch_goes_without_waiting_and_flush_skips_the_delay(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    """A one-hour deadline: a full batch (8) is sent anyway, a partial one waits for it, and
    flush() sends it at once."""
    agent = agent_factory().start()
    code = (
        "import time\nfrom infersight import hooks\nfrom infersight.hooks import _runtime\n"
        "c = _runtime.state().client\n"
        "for i in range(8):\n    hooks.log('e', i=i)\n"
        "deadline = time.time() + 60\n"
        "while c.acked < c.sent_events or c.sent_events < 8:\n"
        "    assert time.time() < deadline, 'a full batch was not sent'\n    time.sleep(0.01)\n"
        "hooks.log('e', i=8)\ntime.sleep(0.5)\n"
        "print(c.sent_events, len(c._buf))\n"  # the ninth waits for its batch
        "assert hooks.flush(30)\nprint(c.sent_events, len(c._buf))\n"
    )
    # No cold-start sampler: its checkpoints (cs_tick, every 100 ms) would fill the batch.
    r = run_hooked(tmp_path, agent, code, INFERSIGHT_BATCH_EVENTS="8", INFERSIGHT_BATCH_DELAY_MS="3600000",
                   INFERSIGHT_SAMPLER="0")
    assert r.returncode == 0, r.stderr
    waiting, flushed = (tuple(map(int, line.split())) for line in r.stdout.splitlines())
    assert waiting[1] == 1, "the ninth event waits for its batch: %r" % (waiting,)
    assert flushed[1] == 0
    assert flushed[0] == waiting[0] + 1, "flush sent it"
    assert agent.stop() == 0
    assert sorted(indices(read_otlp_lines(agent.out))) == list(range(9))


def test_fork_and_exit_skip_the_delay(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    """With a one-hour deadline, a fork sends what the parent queued, and exit sends the rest."""
    agent = agent_factory().start()
    code = (
        "import os, time\nfrom infersight import hooks\nfrom infersight.hooks import _runtime\n"
        "c = _runtime.state().client\nhooks.log('before fork', i=0)\n"
        "pid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\n"
        "deadline = time.time() + 60\n"
        "while c.sent_events < 1:\n    assert time.time() < deadline, 'the fork did not hurry the batch'\n"
        "    time.sleep(0.01)\n"
        "hooks.log('at exit', i=1)\n"
    )
    r = run_hooked(tmp_path, agent, code, INFERSIGHT_BATCH_DELAY_MS="3600000", INFERSIGHT_EXIT_FLUSH_S="30",
                   INFERSIGHT_SAMPLER="0")  # (its checkpoints are sent at once: they would hurry it too)
    assert r.returncode == 0, r.stderr
    assert agent.stop() == 0
    assert sorted(indices(read_otlp_lines(agent.out))) == [0, 1]


def test_bad_batch_settings_fall_back_with_a_note(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    code = ("from infersight import hooks\nfrom infersight.hooks import _runtime, _client\n"
            "c = _runtime.state().client\n"
            "assert (c.batch_events, c.batch_delay_s) == (_client.BATCH_EVENTS, _client.BATCH_DELAY_S)\n"
            "hooks.log('e', i=0)\nprint('ok')\n")
    r = run_hooked(tmp_path, agent, code, INFERSIGHT_BATCH_EVENTS="lots", INFERSIGHT_BATCH_DELAY_MS="-5")
    assert r.stdout.strip() == "ok", r.stderr
    assert "INFERSIGHT_BATCH_EVENTS" in r.stderr
    assert agent.stop() == 0
    assert indices(read_otlp_lines(agent.out)) == [0]


def test_300k_burst_through_launch_arrives_whole(tmp_path: Path) -> None:
    """A tight loop outruns the agent: the buffer spills to the spool, nothing is dropped."""
    n = 300_000
    out = tmp_path / "o.jsonl"
    script = tmp_path / "burst.py"
    script.write_text(
        "import sys\nfrom infersight import hooks\nfrom infersight.hooks import _runtime\n"
        "assert hooks.active()\n"
        "for i in range(%d):\n    hooks.log('e', i=i)\n"
        "c = _runtime.state().client\nprint('dropped', c.dropped_buffer + c.dropped_spool, 'spilled', c.spilled_events,"
        " file=sys.stderr)\n" % n
    )
    r = subprocess.run([sys.executable, "-m", "infersight", "launch", "--no-console", "--otlp-file", str(out),
                        "--", sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "dropped 0 " in r.stderr, r.stderr
    got = indices(read_otlp_lines(out))
    assert len(set(got)) == n, r.stderr
    assert sorted(set(got)) == list(range(n))
    assert "lost" not in r.stderr
