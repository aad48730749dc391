"""The hooks <-> agent contract (docs/wire.md): each frame has one builder and reads back as
documented, the hooks' spool file names are what the agent's replay looks for, and the
shared thresholds and ready signals are defined once, in ``hooks/_contract.py``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from infersight.hooks import _contract, _paths, _wire

ROOT = Path(__file__).resolve().parents[2]


def payload(frame: bytes) -> bytes:
    frames, rest, bad = _wire.split_frames(frame)
    assert len(frames) == 1 and rest == b"" and not bad
    assert _wire.frame_size(frame[: _wire.HEADER.size]) == len(frames[0])
    return frames[0]


def test_the_hello_carries_the_producer_and_what_was_acked() -> None:
    producer = {"id": "boot-1-2", "pid": 1}
    assert _wire.decode_payload(payload(_wire.hello_frame(producer, acked=7))) == {
        "t": "hello", "schema": _wire.SCHEMA_VERSION, "producer": {"id": "boot-1-2", "pid": 1, "acked": 7}}
    assert "acked" not in producer, "the caller's dict is not changed"
    assert _wire.decode_payload(payload(_wire.hello_frame(producer)))["producer"] == producer  # type: ignore[index]


@pytest.mark.parametrize(("frame", "obj"), [
    (_wire.welcome_frame(), {"t": "welcome", "schema": _wire.SCHEMA_VERSION}),
    (_wire.refuse_frame("uid 5 is not allowed"), {"t": "refuse", "schema": _wire.SCHEMA_VERSION,
                                                  "error": "uid 5 is not allowed"}),
    (_wire.ack_frame(2**40), {"t": "ack", "seq": 2**40}),
])
def test_the_agents_replies_read_back_on_both_sides(frame: bytes, obj: dict[str, object]) -> None:
    assert _wire.decode_reply(payload(frame)) == obj  # the hook's parser (no json package)
    assert _wire.decode_payload(payload(frame)) == obj  # the agent's


def test_the_one_frame_requests() -> None:
    assert _wire.decode_payload(payload(_wire.URGENT_FRAME)) == {"t": "urgent"}
    assert _wire.decode_payload(payload(_wire.STATUS_FRAME)) == {"t": "status"}
    assert _wire.decode_payload(payload(_wire.health_frame({"ok": True}))) == {"t": "health", "ok": True}


def test_a_batch_header_reads_without_its_events() -> None:
    frame = _wire.encode_batch([(3, 10, "log", {"body": "a"}), (4, 11, "log", {"body": "b"})])
    assert _wire.batch_header(payload(frame)) == {"t": "b", "n": 2, "l": 4}


def test_an_oversized_frame_is_flagged() -> None:
    frames, _rest, bad = _wire.split_frames(_wire.HEADER.pack(_wire.MAX_FRAME_BYTES + 1) + b"{}")
    assert frames == [] and bad


def test_the_agent_replays_by_the_names_the_hooks_give() -> None:
    name = _paths.spool_file_name("boot-42-7", "0123456789abcdef")
    assert name.endswith(_paths.SPOOL_SUFFIX) and name.startswith(_paths.spool_prefix("boot-42-7"))
    other = _paths.spool_file_name("boot-42-71", "0123456789abcdef")  # pid 42 tick 71: another process
    assert not other.startswith(_paths.spool_prefix("boot-42-7"))


def test_every_frame_builder_is_documented() -> None:
    doc = (ROOT / "docs" / "wire.md").read_text()
    builders = [n for n in vars(_wire) if re.fullmatch(r"[a-z_]+_frame|[A-Z_]+_FRAME|encode_batch", n)]
    assert len(builders) >= 8
    assert [n for n in builders if "`%s" % n not in doc] == []


def _literal_assignments(path: Path) -> list[tuple[str, object]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                continue
            out += [(t.id, value) for t in targets if isinstance(t, ast.Name)]
    return out


def test_shared_thresholds_and_ready_signals_are_defined_once() -> None:
    """No module of ours but ``_contract`` spells the cold-read threshold, the gap sample
    minimum or the ready signals out again (they were in five, two and two places)."""
    again = []
    for folder in ("hooks", "agent", "infersight", "exporters", "rules"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "_contract.py":
                continue
            for name, value in _literal_assignments(path):
                shared = ("COLD_BELOW" in name or "SAMPLES" in name and value == _contract.MIN_GAP_SAMPLES
                          or isinstance(value, (tuple, set, frozenset)) and "listening_socket" in value)
                if shared:
                    again.append("%s: %s = %r" % (path.relative_to(ROOT), name, value))
    assert again == []


def test_the_contracts_attribute_names_are_spelled_only_there() -> None:
    names = {v for k, v in vars(_contract).items() if k.isupper() and isinstance(v, str)
             and v.startswith("infersight.") and not v.endswith(".")}
    assert len(names) >= 15
    spelled = []
    for folder in ("hooks", "agent", "infersight", "exporters", "rules"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if path.name == "_contract.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and node.value in names:
                    spelled.append("%s:%d %s" % (rel, node.lineno, node.value))
    assert spelled == [], "use infersight.hooks._contract's names:\n" + "\n".join(spelled)
