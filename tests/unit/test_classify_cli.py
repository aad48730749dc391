"""``classify`` through its module (the lead mounts it into ``infersight``)."""

from __future__ import annotations

import argparse
import io
import json
import pickle
from pathlib import Path

import pytest

from infersight.agent.commands import classify as classify_cmd
from infersight.agent.commands.classify import main

FRAG = (
    "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.70 GiB. GPU 0 has a "
    "total capacty of 6.00 GiB of which 0 bytes is free. Of the allocated memory 2.93 GiB is "
    "allocated by PyTorch, and 2.30 GiB is reserved by PyTorch but unallocated."
)
CAP = (
    "RuntimeError: CUDA out of memory. Tried to allocate 92.00 MiB (GPU 0; 1.96 GiB total "
    "capacity; 1.46 GiB already allocated; 16.38 MiB free; 1.51 GiB reserved in total by "
    "PyTorch)"
)
DESIGN_KEYS = {"class", "rule", "requested_bytes", "numbers", "remedy", "note", "engine"}


@pytest.fixture(autouse=True)
def _no_site_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "site-rules"
    empty.mkdir()
    monkeypatch.setenv("INFERSIGHT_RULES_DIR", str(empty))
    monkeypatch.delenv("INFERSIGHT_RULES_DIRS", raising=False)


def _file(tmp_path: Path, text: str, name: str = "log.txt") -> str:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return str(p)


def _json_lines(out: str) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_json_has_the_design_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json", _file(tmp_path, FRAG + "\n" + CAP)]) == 0
    objs = _json_lines(capsys.readouterr().out)
    assert [o["class"] for o in objs] == ["fragmentation", "capacity"]
    for o in objs:
        assert set(o) >= DESIGN_KEYS
        assert set(o) - DESIGN_KEYS <= {"used", "missing"}  # no reason: the class is known
        assert o["engine"] == "pytorch"
        assert list(o["numbers"]) == list("RTFAPUOL")
        assert all(v is None or isinstance(v, int) for v in o["numbers"].values())
    assert objs[0]["requested_bytes"] == round(1.7 * (1 << 30))
    assert objs[0]["rule"] == "oom.fragmentation"
    assert objs[0]["numbers"]["U"] is None


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-8-sig", "utf-8"])
def test_a_log_saved_as_utf16_is_read(tmp_path: Path, capsys: pytest.CaptureFixture[str], encoding: str) -> None:
    """Windows PowerShell's ``>`` writes UTF-16 with a byte-order mark; a log converted without one
    is every other byte NUL: both are read as text (they were 'no OOM message found')."""
    path = tmp_path / "server.log"
    path.write_bytes(("starting\r\n" + FRAG + "\r\n").encode(encoding))
    assert main(["--json", str(path)]) == 0
    assert [o["class"] for o in _json_lines(capsys.readouterr().out)] == ["fragmentation"]


def test_undecodable_bytes_are_replaced_never_fatal() -> None:
    assert classify_cmd.decode_log(b"\xff\xfe") == ""
    assert "\ufffd" in classify_cmd.decode_log(b"ok \xc3\x28 ok")
    assert classify_cmd.decode_log(bytes(range(256)) * 8)  # binary: text with replacements, no exception


def test_repeated_message_counts_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = "\n".join([FRAG, "retrying...", FRAG, json.dumps({"detail": FRAG})])
    assert main(["--json", _file(tmp_path, text)]) == 0
    assert len(_json_lines(capsys.readouterr().out)) == 1


def test_human_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([_file(tmp_path, FRAG)]) == 0
    out = capsys.readouterr().out
    assert "class   fragmentation" in out
    assert "rule    oom.fragmentation v1" in out
    assert "R=1.70 GiB" in out
    assert "T=6.00 GiB" in out
    assert "U=-" in out
    assert "C=2.30 GiB" in out
    assert "remedy  Change the allocator settings" in out


def test_unknown_names_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json", _file(tmp_path, "XPU out of memory. Tried to allocate 2.00 GiB")]) == 0
    (o,) = _json_lines(capsys.readouterr().out)
    assert o["class"] == "unknown"
    assert o["missing"] == ["F", "A", "P"]
    assert o["note"] == "missing: F, A, P"


def test_no_oom_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([_file(tmp_path, "all good\n")]) == 1
    assert "no OOM" in capsys.readouterr().err


RETRY_WARNING = ("[rank1]:[W101 10:00:00.000000000 CUDACachingAllocator.cpp:3933] memory allocation failed with OOM on "
                 "device 1 while trying to allocate 4337916928 bytes (free: 3779919872, total: 287431131136).")


def test_a_warning_that_is_no_oom_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A line that looks like an OOM but is a warning the runtime recovers from (PyTorch's allocator retries
    after it): no finding, exit 1, and the line is named with the reason, on stderr (stdout stays empty)."""
    assert main([_file(tmp_path, "INFO start\n" + RETRY_WARNING + "\nINFO served\n")]) == 1
    cap = capsys.readouterr()
    assert cap.out == ""
    assert "no OOM message found" in cap.err
    assert ("line 2: not an out-of-memory error (pytorch.alloc-retry.warning): A warning PyTorch's caching "
            "allocator logs before it frees its cached blocks and retries") in cap.err


def test_the_error_after_a_retry_warning_is_the_finding(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.04 GiB. GPU 1 has a total capacity of "
           "267.69 GiB of which 3.52 GiB is free. Including non-PyTorch memory, this process has 264.16 GiB memory in "
           "use. Of the allocated memory 262.00 GiB is allocated by PyTorch, and 100.00 MiB is reserved by PyTorch but "
           "unallocated.")
    assert main(["--json", _file(tmp_path, RETRY_WARNING + "\n" + err + "\n")]) == 0
    (found,) = _json_lines(capsys.readouterr().out)
    assert found["class"] == "capacity" and found["engine"] == "pytorch"


def test_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    class _Stdin:
        buffer = io.BytesIO(CAP.encode())

    monkeypatch.setattr("sys.stdin", _Stdin())
    assert main(["--json", "-"]) == 0
    assert _json_lines(capsys.readouterr().out)[0]["class"] == "capacity"


@pytest.mark.parametrize(
    "argv",
    [["--bogus"], ["a", "b"], ["--request", "1GiB", "x"], ["--snapshot", "s", "--request", "big"]],
)
def test_bad_usage_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert capsys.readouterr().err


def test_unreadable_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "absent.log")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_invalid_rule_file_exits_2_with_file_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rules = tmp_path / "rules"
    rules.mkdir()
    bad = rules / "bad.toml"
    bad.write_text('engine_version = "1.0"\n\n[[rule]]\nid = "x"\nclass = "nope"\n')
    assert main(["--rules-dir", str(rules), _file(tmp_path, FRAG)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:5: x: class must be one of" in err
    assert main(["--rules-dir", str(tmp_path / "nodir"), _file(tmp_path, FRAG)]) == 2


@pytest.mark.parametrize(("variable", "value"), [
    ("INFERSIGHT_RULES_DIR", "{site}"),  # classify's own, before it read the agent's
    ("INFERSIGHT_RULES_DIRS", "{site}"),  # the agent's rules.dirs (README): the same rules live and pasted
    ("INFERSIGHT_RULES_DIRS", "/nonexistent:{site}"),
])
def test_site_rules_dir_from_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], variable: str, value: str
) -> None:
    site = tmp_path / "etc-rules"
    site.mkdir()
    (site / "10-site.toml").write_text(
        'engine_version = "1.0"\n[[rule]]\nid = "site.all-capacity"\nversion = 1\n'
        'class = "capacity"\npriority = 1\ncondition = "R >= 1GiB"\nremedy = "site policy"\n'
        '[[rule.examples]]\nkind = "positive"\nnumbers = { R = "2 GiB" }\n'
        '[[rule.examples]]\nkind = "negative"\nnumbers = { R = "2 MiB" }\n'
    )
    monkeypatch.delenv("INFERSIGHT_RULES_DIR", raising=False)
    monkeypatch.setenv(variable, value.format(site=site))
    assert main(["--json", _file(tmp_path, FRAG)]) == 0
    (o,) = _json_lines(capsys.readouterr().out)
    assert (o["class"], o["rule"], o["remedy"]) == ("capacity", "site.all-capacity", "site policy")


def _snapshot_file(tmp_path: Path) -> str:
    """SYNTHETIC snapshot, the structure of torch.cuda.memory._snapshot()."""
    mib = 1 << 20
    blocks = [
        {"size": 40 * mib, "requested_size": 40 * mib, "address": 0, "state": "active_allocated", "frames": []},
        {"size": 24 * mib, "requested_size": 0, "address": 40 * mib, "state": "inactive", "frames": []},
    ]
    seg = {
        "address": 0,
        "total_size": 64 * mib,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "allocated_size": 40 * mib,
        "active_size": 40 * mib,
        "blocks": blocks,
    }
    p = tmp_path / "snap.pickle"
    p.write_bytes(pickle.dumps({"segments": [seg, dict(seg, address=1 << 30)], "device_traces": []}))
    return str(p)


def test_snapshot_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snap = _snapshot_file(tmp_path)
    assert main(["--json", "--snapshot", snap, "--request", "32MiB"]) == 0
    (o,) = _json_lines(capsys.readouterr().out)
    s = o["snapshot"]
    assert s["segments"] == 2
    assert s["largest_free_block"] == 24 << 20
    assert s["fragmentation_ratio"] == pytest.approx(0.5)
    assert s["verdict"]["outcome"] == "fragmentation"
    assert s["verdict"]["rubric"]["class"] == "fragmentation"


def test_snapshot_human_and_text_together(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snap = _snapshot_file(tmp_path)
    assert main(["--snapshot", snap, "--request", "16MiB", _file(tmp_path, CAP)]) == 0
    out = capsys.readouterr().out
    assert "Snapshot: 2 segments" in out
    assert "request 16.00 MiB: fits" in out
    assert "rubric  none: the cache serves this request" in out and "rubric  fragmentation" not in out
    assert "class   capacity" in out
    assert main(["--json", "--snapshot", snap, "--request", "16MiB"]) == 0
    (o,) = _json_lines(capsys.readouterr().out)
    assert o["snapshot"]["verdict"]["outcome"] == "fits" and o["snapshot"]["verdict"]["rubric"] is None


def test_refused_snapshot_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "evil.pickle"
    p.write_bytes(b"cos\nsystem\n(S'true'\ntR.")
    assert main(["--snapshot", str(p)]) == 2
    assert "refused global os.system" in capsys.readouterr().err


def test_add_parser_mounts_on_a_subcommand_parser(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    top = argparse.ArgumentParser(prog="infersight")
    sub = top.add_subparsers(dest="command")
    classify_cmd.add_parser(sub)
    args = top.parse_args(["classify", "--json", _file(tmp_path, CAP)])
    assert args.func is classify_cmd.run
    assert args.func(args) == 0
    assert _json_lines(capsys.readouterr().out)[0]["class"] == "capacity"

