"""The ETA history's byte budget: a run is bounded in bytes, one uid's share of the history (in
memory and in the file) too, and the file never grows past what a load reads back, so that a
stranger's flood of huge-stage-name runs cannot push another uid's run out: not in memory, not
at a compaction, not at an agent restart. Real tracker, real history file in a temp directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

from infersight.agent.coldstart import history as ch
from infersight.agent.coldstart.eta import MAX_STAGES, Run
from infersight.agent.coldstart.progress import ProgressTracker
from infersight.telemetry import ColdStart, Origin, Resource, SpanItem

S = 1_000_000_000
VICTIM, ATTACKER = 1000, 1001


def cold_start(uid: int, service: str, n: int, stage_names: list[str], total_s: float = 5.0) -> ColdStart:
    """A finished cold start of producer ``n``: one top-level stage per name, then the root."""
    res = Resource.of({"service.name": service, "process.user.id": uid, "process.pid": 0,
                       "process.command": "serve"})
    root_id, start = "%016x" % (n + 1), n * 1000 * S
    stages = [SpanItem(res, "%032x" % (n + 1), "%016x" % (10**6 + i), root_id, "coldstart.s",
                       start + i * 1000, start + i * 1000 + 500, {"infersight.stage": name})
              for i, name in enumerate(stage_names)]
    root = SpanItem(res, "%032x" % (n + 1), root_id, None, "coldstart", start, start + int(total_s * S),
                    origin=Origin("p%d" % n, 1))
    return ColdStart(root, stages)


VICTIM_STAGES = ["framework_import", "model_build", "weights_load", "warmup"]


def huge_stages(width: int) -> list[str]:
    return [("%03d" % k) + "x" * (width - 3) for k in range(MAX_STAGES)]


def victim_totals(h: ch.History) -> list[float]:
    return [r.total_s for k, runs in h.runs.items() if ch.key_uid(k) == VICTIM for r in runs]


def uid_bytes(h: ch.History, uid: int) -> int:
    """The uid's runs as the file's lines count them."""
    return sum(len(json.dumps(ch.run_to_json(k, r), separators=(",", ":"))) + 1
               for k, runs in h.runs.items() if ch.key_uid(k) == uid for r in runs)


def flood(t: ProgressTracker, services: int, runs: int, width: int, first: int = 100) -> None:
    names = huge_stages(width)
    n = first
    for _ in range(runs):
        for i in range(services):
            t.observe([cold_start(ATTACKER, "hog-%d" % i, n, names, total_s=500.0)])
            n += 1


def test_a_run_is_bounded_in_bytes_and_what_is_cut_is_counted() -> None:
    h = ch.History()
    key = ch.service_key("s" * 5000, ["serve"], uid=ATTACKER)
    assert len(key) < ch.MAX_KEY and ch.key_uid(key) == ATTACKER
    assert key != ch.service_key("s" * 4999 + "t", ["serve"], uid=ATTACKER)  # the hash tells them apart
    huge = Run(tuple((n, 0.001, 0.001 * i) for i, n in enumerate(huge_stages(4000))), 9.0, "c" * 4000, 1.0)
    kept = h.add(key, huge)
    assert ch.run_bytes(key, kept) <= ch.MAX_RUN_BYTES and len(kept.cache) == ch.MAX_CACHE
    assert kept.stages and all(len(s) == ch.MAX_STAGE_NAME for s, _d, _e in kept.stages)
    assert h.runs_cut == 1 and h.bytes == ch.run_bytes(key, kept)
    small = Run((("weights_load", 1.0, 2.0),), 3.0, "weights=warm,compile=none", 2.0)
    assert h.add(key, small) == small and h.runs_cut == 1  # an ordinary run is kept as is
    # One key's newest runs always fit its uid's share: the share never costs a uid its newest run.
    assert ch.MAX_RUNS * ch.MAX_RUN_BYTES <= ch.MAX_BYTES_PER_UID
    assert ch.MAX_HISTORY_BYTES <= ch.MAX_FILE_BYTES - ch.MAX_RUN_BYTES


def test_one_uid_cannot_push_another_uids_run_out_by_bytes(tmp_path: Path) -> None:
    """16 services x 14 runs of 256 stages named with 1 KB each (old: a 57 MB file, and the
    victim's second run, written after it, lost on reload): in memory, at the compactions on the
    way, after a restart and after one more compaction, the victim keeps both runs."""
    path = str(tmp_path / "state" / ch.FILE_NAME)
    os.makedirs(os.path.dirname(path), mode=0o700)
    t = ProgressTracker(path, proc_root=str(tmp_path / "noproc"))
    t.observe([cold_start(VICTIM, "victim-svc", 1, VICTIM_STAGES, total_s=7.0)])
    flood(t, services=16, runs=14, width=1000)
    t.observe([cold_start(VICTIM, "victim-svc", 2, VICTIM_STAGES, total_s=8.0)])
    assert t.recorded == 2 + 16 * 14 and t.record_errors == 0

    assert victim_totals(t.history) == [7.0, 8.0]
    restarted = ProgressTracker(path)  # an agent restart reads the file back
    assert victim_totals(restarted.history) == [7.0, 8.0]
    assert restarted.history.corrupt_lines == 0

    assert uid_bytes(t.history, ATTACKER) <= ch.MAX_BYTES_PER_UID
    assert t.history.bytes <= ch.MAX_HISTORY_BYTES and restarted.history.bytes <= ch.MAX_HISTORY_BYTES
    assert t.history.runs_cut >= 16 * 14 and t.history.runs_pushed_out > 0  # counted
    assert os.path.getsize(path) <= ch.MAX_FILE_BYTES
    compacted = ch.compact(path)
    assert victim_totals(compacted) == [7.0, 8.0]
    assert victim_totals(ch.load(path)) == [7.0, 8.0]
    assert os.path.getsize(path) == compacted.bytes <= ch.MAX_HISTORY_BYTES


def test_the_file_stays_within_what_a_load_reads_and_compaction_keeps_the_victim(tmp_path: Path) -> None:
    """The victim keeps many small runs (16 services x 50), so the file's line count would let
    it grow far; the attacker's 16 KiB lines fill it by bytes instead. The tracker compacts
    before the file passes MAX_FILE_BYTES (old: 13 MB, of which a load read 8 MiB), and the
    compaction, which re-reads the file, keeps every victim run, one recorded mid-flood too."""
    path = str(tmp_path / ch.FILE_NAME)
    t = ProgressTracker(path, proc_root=str(tmp_path / "noproc"))
    for r in range(ch.MAX_RUNS):
        for i in range(16):
            t.observe([cold_start(VICTIM, "victim-%d" % i, 1 + 16 * r + i, VICTIM_STAGES, total_s=7.0)])
    sizes = []
    for r in range(36):  # ~16 KiB a line: the bytes, not the line count, call for compaction
        flood(t, services=16, runs=1, width=64, first=10_000 + 16 * r)
        sizes.append(os.path.getsize(path))
        if r == 10:
            t.observe([cold_start(VICTIM, "victim-0", 9_999, VICTIM_STAGES, total_s=8.0)])
    assert max(sizes) <= ch.MAX_FILE_BYTES
    assert min(sizes[10:]) < max(sizes) // 2  # compacted on the way, by bytes
    for h in (t.history, ch.load(path)):
        mine = {k: [r.total_s for r in runs] for k, runs in h.runs.items() if ch.key_uid(k) == VICTIM}
        assert len(mine) == 16 and all(len(v) == ch.MAX_RUNS for v in mine.values())
        assert sorted(v[-1] for v in mine.values()) == [7.0] * 15 + [8.0]
        assert uid_bytes(h, ATTACKER) <= ch.MAX_BYTES_PER_UID


def test_an_oversized_file_of_an_older_agent_is_read_whole_and_long_lines_skipped(tmp_path: Path) -> None:
    """A file an older agent left past MAX_FILE_BYTES (huge lines first): a load reads it to the
    end, so the victim's run written after the flood survives the upgrade; the flood's lines
    longer than MAX_LINE_BYTES are skipped unread and counted."""
    path = tmp_path / ch.FILE_NAME
    victim_key = ch.service_key("victim-svc", ["serve"], uid=VICTIM)
    hog = json.dumps({"key": ch.service_key("hog", ["serve"], uid=ATTACKER), "total_s": 1.0, "cache": "x",
                      "stages": [[n, 0.001, 0.001] for n in huge_stages(4000)]})
    victim = json.dumps(ch.run_to_json(victim_key, Run((("weights_load", 1.0, 2.0),), 3.0, "c", 1.0)))
    with open(path, "w") as f:
        for _ in range(ch.MAX_FILE_BYTES // len(hog) + 2):
            f.write(hog + "\n")
        f.write(victim + "\n")
    assert path.stat().st_size > ch.MAX_FILE_BYTES
    h = ch.load(str(path))
    assert [r.total_s for r in h.of(victim_key)] == [3.0]
    assert h.corrupt_lines == ch.MAX_FILE_BYTES // len(hog) + 2 and h.bytes_read == path.stat().st_size


def test_a_file_another_writer_filled_is_compacted_with_the_run_not_grown(tmp_path: Path) -> None:
    """Another writer (``launch``) filled the file to its bound behind the tracker's back: the
    append is refused, and the tracker compacts with the run in it instead."""
    path = str(tmp_path / ch.FILE_NAME)
    t = ProgressTracker(path, proc_root=str(tmp_path / "noproc"))
    big = Run(tuple((n, 0.001, 0.001) for n in huge_stages(64)), 1.0, "c", 1.0)
    small = Run((("s", 0.001, 0.001),), 1.0, "c", 1.0)
    for i, run in enumerate((big, small)):
        while ch.append(path, ch.service_key("h%d" % (i * 1000 + len(run.stages)), ["x"], uid=ATTACKER),
                        run) is not None:
            pass
    full = os.path.getsize(path)
    assert ch.MAX_FILE_BYTES - 200 < full <= ch.MAX_FILE_BYTES
    t.observe([cold_start(VICTIM, "victim-svc", 1, VICTIM_STAGES, total_s=7.0)])
    assert os.path.getsize(path) < full and victim_totals(t.history) == [7.0]
    assert victim_totals(ch.load(path)) == [7.0] and t.bytes_on_disk == os.path.getsize(path)
