"""`infersight baseline` on the CPU: JSON shape per DESIGN's contract, no_peers verdict."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from infersight.agent.commands import baseline as baseline_cmd

KEYS = {"device", "hw_id", "name", "p50_s", "p99_s", "coefficient", "verdict", "cause"}


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="infersight")
    baseline_cmd.add_parser(p.add_subparsers(dest="command"))
    return p.parse_args(["baseline", *argv])


def test_parser_registers_baseline() -> None:
    a = _args(["--json", "--requests", "7", "--devices", "cpu", "cuda:0"])
    assert a.func is baseline_cmd.run
    assert a.json is True
    assert a.requests == 7
    assert a.devices == ["cpu", "cuda:0"]
    assert _args([]).requests == baseline_cmd.DEFAULT_REQUESTS


@pytest.mark.torch
def test_json_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    assert baseline_cmd.run(_args(["--json", "--requests", "20", "--devices", "cpu"])) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"devices", "note"}
    (row,) = doc["devices"]
    assert set(row) == KEYS
    assert row["device"] == "cpu"
    assert row["hw_id"] is None
    assert isinstance(row["name"], str)
    assert 0 < row["p50_s"] <= row["p99_s"]
    assert row["coefficient"] is None
    assert row["verdict"] == "no_peers"
    assert row["cause"] is None
    assert "cpu" in doc["note"]
    assert "with 20 requests the P99 is the slowest one" in doc["note"]


@pytest.mark.torch
def test_default_devices_and_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    assert baseline_cmd.run(_args(["--requests", "5"])) == 0
    out = capsys.readouterr().out
    assert "p99 ms" in out
    assert "note:" in out
    if not torch.cuda.is_available():
        assert "no GPU visible: ran on cpu only" in out
        assert "no_peers" in out


@pytest.mark.torch
def test_duplicate_devices_run_once(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    assert baseline_cmd.run(_args(["--json", "--requests", "3", "--devices", "cpu,cpu"])) == 0
    assert len(json.loads(capsys.readouterr().out)["devices"]) == 1


def test_without_torch_exits_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    assert baseline_cmd.run(_args(["--json"])) == 2
    err = capsys.readouterr().err
    assert "needs torch" in err
    assert "infersight[torch]" in err


@pytest.mark.torch
@pytest.mark.parametrize("argv", [["--requests", "0"], ["--devices", "tpu:0"], ["--devices", "cuda:99"]])
def test_bad_usage_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    assert baseline_cmd.run(_args(argv)) == 2
    assert "infersight baseline:" in capsys.readouterr().err
