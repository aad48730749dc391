"""What launch pays before CMD runs: lazy CLI imports, spawn before the agent side, --evict."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import log_records, read_otlp_lines, spans

CLI = [sys.executable, "-m", "infersight"]
# What the agent side costs (asyncio alone ~35 ms, the OTel protobufs far more).
HEAVY = ("asyncio", "infersight.agent.daemon.config", "infersight.agent.daemon.lifecycle", "infersight.hooks",
         "infersight.exporters.otlp_json", "opentelemetry", "google.protobuf", "json", "logging")


def run_py(code: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    # No INFERSIGHT_*/OTEL_* settings: with any, launch checks the config before CMD starts.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "INFERSIGHT"))}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=cwd,
                          env=env)


def test_help_imports_nothing_heavy() -> None:
    r = run_py("import sys\nfrom infersight.agent import cli\n"
               "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
               "print('LOADED', sorted(m for m in %r if m in sys.modules))" % (HEAVY,))
    assert r.returncode == 0, r.stderr
    assert "launch" in r.stdout and "classify" in r.stdout and "install-service" in r.stdout
    assert r.stdout.strip().splitlines()[-1] == "LOADED []"


def test_every_command_is_listed_with_the_help_its_module_registers() -> None:
    from infersight.agent import cli

    full = cli.build_parser()
    sub = next(a for a in full._actions if a.dest == "command")
    helps = {a.dest: a.help for a in sub._choices_actions}  # type: ignore[attr-defined]
    assert helps == {name: help_line for name, help_line, _add in cli.COMMANDS}


def test_default_config_path_matches_config() -> None:
    from infersight.agent import cli
    from infersight.agent.daemon import config as cfg

    assert cli.DEFAULT_CONFIG_PATH == cfg.DEFAULT_CONFIG_PATH


@pytest.mark.parametrize("argv", [["classify", "--help"], ["launch", "--help"], ["status", "--help"]])
def test_a_command_gets_its_full_parser(argv: list[str]) -> None:
    r = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    assert "usage: infersight %s" % argv[0] in r.stdout
    if argv[0] == "launch":
        assert "--evict" in r.stdout


def test_unknown_command_is_a_usage_error() -> None:
    r = subprocess.run([*CLI, "nope"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_cmd_is_spawned_before_the_agent_side_is_imported(tmp_path: Path) -> None:
    """At the moment CMD is spawned, launch holds none of the agent's heavy modules."""
    code = ("import sys\nfrom infersight.agent import cli\nfrom infersight.agent.commands import launch\n"
            "real = launch.spawn\n"
            "def spy(cmd, env):\n"
            "    sys.stderr.write('AT-SPAWN %%s\\n' %% sorted(m for m in %r if m in sys.modules))\n"
            "    return real(cmd, env)\n"
            "launch.spawn = spy\n"
            "sys.exit(cli.main(['launch', '--no-console', '--otlp-file', 'o.jsonl', '--', sys.executable, '-c', "
            "'from infersight import hooks; hooks.log(\"x\")']))\n" % (HEAVY,))
    r = run_py(code, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "AT-SPAWN []" in r.stderr
    # ...and the hooks that connected while the agent was still importing lost nothing.
    roots = [s for s in spans(read_otlp_lines(tmp_path / "o.jsonl")) if s["name"] == "coldstart"]
    assert len(roots) == 1


# What launch's agent does not import for a CMD that starts and exits (no config file, no
# GPU driver, no routing, no verdict due): each loads at its first use instead. Nor the
# served process's runtime of the hooks (their package's __init__: client, recorder).
DEFERRED = ("tomllib", "infersight.agent.routing.table", "infersight.agent.routing.agentcheck",
            "infersight.agent.devices.heterogeneity", "infersight.hooks._client", "infersight.hooks._recorder")


def test_the_embedded_agent_defers_what_a_cold_start_does_not_use(tmp_path: Path) -> None:
    """Launch's whole run (agent start, CMD's cold start, the flush and the closing report)
    without tomllib, the routing table, the device verdicts, the hooks' runtime, nor pynvml
    where no driver is installed: and the hooks' events all arrive."""
    code = ("import ctypes, sys\nfrom infersight.agent import cli\nfrom infersight.agent.commands import launch\n"
            "deferred = list(%r)\n"
            "try:\n    ctypes.CDLL('libnvidia-ml.so.1')\nexcept OSError:\n    deferred.append('pynvml')\n"
            "real_module = launch.AgentSide.module\n"
            "def module(self):\n"
            "    m = real_module(self)\n"
            "    real_run = m.run\n"
            "    def run(*a, **k):\n"
            "        rc = real_run(*a, **k)\n"
            "        sys.stderr.write('AT-END %%s\\n' %% sorted(x for x in deferred if x in sys.modules))\n"
            "        return rc\n"
            "    m.run = run\n"
            "    return m\n"
            "launch.AgentSide.module = module\n"
            "sys.exit(cli.main(['launch', '--no-console', '--otlp-file', 'o.jsonl', '--', sys.executable, '-c', "
            "'import time; from infersight import hooks; hooks.log(\"x\"); time.sleep(0.5)']))\n" % (DEFERRED,))
    r = run_py(code, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "AT-END []" in r.stderr, r.stderr
    records = read_otlp_lines(tmp_path / "o.jsonl")
    assert len([s for s in spans(records) if s["name"] == "coldstart"]) == 1
    assert [rec["body"]["stringValue"] for rec in log_records(records)] == ["x"]
    assert "lost" not in r.stderr


RESIDENCY = ("import os, sys\nfrom infersight.agent.commands import pagecache\n"
             "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
             "print(pagecache.resident_pages(fd, os.fstat(fd).st_size))\n")


def _cached_file(path: Path, size: int) -> None:
    path.write_bytes(os.urandom(size))
    path.read_bytes()  # in the page cache now (and dirty until written back)


def test_evict_drops_files_from_the_page_cache_before_cmd(tmp_path: Path) -> None:
    from infersight.agent.commands import pagecache

    model = tmp_path / "model"
    model.mkdir()
    weights = model / "weights.bin"
    _cached_file(weights, 8 << 20)
    (model / "link.bin").symlink_to(weights)  # a Hugging Face snapshot links to its blobs: counted once
    _cached_file(model / "config.json", 100)
    pages = -(-(8 << 20) // pagecache.PAGE)
    fd = os.open(weights, os.O_RDONLY)
    try:
        assert pagecache.resident_pages(fd, 8 << 20) == pages  # precondition: fully cached
    finally:
        os.close(fd)
    r = subprocess.run([*CLI, "launch", "--no-console", "--otlp-file", str(tmp_path / "o.jsonl"),
                        "--evict", str(model), "--", sys.executable, "-c", RESIDENCY, str(weights)],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.strip()) == 0, "CMD found the file still cached"
    total = pages + 1  # and config.json's page
    assert ("evicted 2 file(s), 8.0 MiB, from the page cache (resident before: %d of %d pages, 100%%; after: 0, 0%%)"
            % (total, total)) in r.stderr


def test_evict_of_a_missing_path_is_a_usage_error_before_cmd(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    r = subprocess.run([*CLI, "launch", "--evict", str(tmp_path / "nope"), "--", "touch", str(marker)],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 2 and "--evict" in r.stderr and "nope" in r.stderr
    assert not marker.exists()


def test_evict_says_what_stayed_resident(tmp_path: Path) -> None:
    """Pages that cannot be dropped (tmpfs here) are reported, not hidden."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    f = shm / ("infersight-test-%d" % os.getpid())
    try:
        _cached_file(f, 1 << 20)
        from infersight.agent.commands import pagecache

        ev = pagecache.evict([str(f)])
        assert ev.files == 1 and ev.resident_after == ev.pages
        lines = pagecache.describe(ev)
        assert "after: %d, 100%%" % ev.pages in lines[0] and str(f) in lines[1]
    finally:
        f.unlink()


def test_evict_flag_order(tmp_path: Path) -> None:
    """--evict takes several paths, is repeatable, and still leaves CMD after --."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x" * 4096)
    b.write_bytes(b"y" * 4096)
    r = subprocess.run([*CLI, "launch", "--no-console", "--otlp-file", str(tmp_path / "o.jsonl"),
                        "--evict", str(a), "--evict", str(b), str(a), "--", sys.executable, "-c",
                        "import json, sys; print(json.dumps(sys.argv))", "arg"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == ["-c", "arg"]
    assert "evicted 2 file(s)" in r.stderr


async def test_hooks_that_connect_before_the_agent_is_up_lose_nothing(tmp_path: Path) -> None:
    """launch listens before it spawns CMD, and starts its agent later. A producer that
    connects meanwhile waits in the backlog; if it gives up (2 s) it spools and exits; the
    agent, once up, takes the stale connection and replays the spool: every event, once."""
    import socket

    from conftest import hook_env, log_records, wait_for

    from infersight.agent.commands.compose import build_exporters
    from infersight.agent.daemon import config as cfg
    from infersight.agent.daemon.lifecycle import Agent

    sock, spool, out = tmp_path / "agent.sock", tmp_path / "spool", tmp_path / "o.jsonl"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock))
    listener.listen(128)
    code = "from infersight import hooks\nfor i in range(500):\n    hooks.log('e%d' % i)\n"
    r = subprocess.run([sys.executable, "-c", code], env=hook_env(sock, spool), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert list(spool.iterdir()), "the producer spooled (its hello was never answered)"
    conf = cfg.load(None, env={}, flags={"agent.socket": str(sock), "agent.spool_dir": str(spool),
                                         "exporters.file.path": str(out), "agent.allowed_uids": [os.getuid()]})
    agent = Agent(conf, build_exporters(conf, env={}), embedded=True, listen_sock=listener,
                  exporter_spool_root=str(tmp_path / "xspool"))
    await agent.start()
    try:
        assert await asyncio.to_thread(wait_for, lambda: not list(spool.iterdir()), 20)
    finally:
        await agent.shutdown(10)
    got = [rec["body"]["stringValue"] for rec in log_records(read_otlp_lines(out))]
    assert sorted(got) == sorted("e%d" % i for i in range(500))
    assert agent.health()["lost"] == 0
