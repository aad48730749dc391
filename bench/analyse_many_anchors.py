"""``analyse`` on long texts full of anchors: this tree against another revision's, side by side.

    python bench/analyse_many_anchors.py [--rounds 5] [--other-rev REV]

``infersight classify`` reads a whole log at once; a log of tens of thousands of lines that each hold a
needle (an engine's warning every step, a fallback phrase on every line) is where its cost shows. Three
texts: 10,000 distinct lines that only the generic fallback rule anchors on ("ERROR ... out of memory in
worker N"), 20,000 lines of busy engine logs that are no memory error (vLLM's stats line, SGLang's
retraction notice, llama-server's KV-cache retries), and 5,000 PyTorch allocator messages of 900 sizes.
Each round runs every text once in a fresh interpreter per tree, alternating the trees; prints the median
seconds of each, their ratio (this tree / the other), and whether both found the same things.
``--other-rev`` (default ``HEAD``): the revision to compare with, laid out as installed from ``git
archive`` in a temporary directory (so with uncommitted changes, HEAD is "before").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# where each source folder goes in the installed package (pyproject's package-dir)
LAYOUT = {"infersight": "infersight", "agent": "infersight/agent", "hooks": "infersight/hooks",
          "exporters": "infersight/exporters", "rules": "infersight/rules"}

RUN = """
import json, sys, time
from infersight.rules.serving import analyse
analyse("x")  # rules loaded, patterns compiled
texts = json.load(open(sys.argv[1]))
out = {}
for name, text in texts.items():
    t0 = time.perf_counter()
    found = analyse(text)
    out[name] = [time.perf_counter() - t0, [[f.rule, f.cls, f.key] for f in found]]
import infersight.rules.serving as m
print(json.dumps({"module": m.__file__, "runs": out}))
"""


def texts() -> dict[str, str]:
    generic = "\n".join("ERROR something failed: out of memory in worker %d" % i for i in range(10_000))
    busy = []
    for i in range(5_000):
        busy += ["INFO 12-05 10:00:%02d [metrics.py:1] Avg prompt throughput: 10 tokens/s, GPU KV cache usage: "
                 "95.0%%, CPU KV cache usage: 0.0%%" % (i % 60),
                 "[2025-03-07 21:49:33 TP13] Decode out of memory happened. #retracted_reqs: 1, #new_token_ratio: "
                 "0.1474 -> 0.1845",
                 "decode: failed to find a memory slot for batch of size 512",
                 "srv  update_slots: failed to find free space in the KV cache, retrying with smaller batch size, "
                 "i = 0, n_batch = 256, ret = 1"]
    pytorch = "\n".join("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate %d.00 MiB. GPU 0 has a total "
                        "capacity of 23.53 GiB of which 315.44 MiB is free." % (i % 900 + 1) for i in range(5_000))
    return {"generic fallback, 10k lines": generic, "busy engine logs, 20k lines": "\n".join(busy),
            "PyTorch messages, 5k lines": pytorch}


def lay_out(rev: str, dest: Path) -> None:
    """``rev``'s package, as installed, under ``dest``."""
    blob = subprocess.run(["git", "-C", str(ROOT), "archive", rev, *LAYOUT], check=True, capture_output=True).stdout
    src = dest / "src"
    src.mkdir()
    archive = dest / "rev.tar"
    archive.write_bytes(blob)
    with tarfile.open(archive) as tar:  # (our own archive; the data filter where this Python has it)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(src, filter="data")
        else:
            tar.extractall(src)
    for folder, target in LAYOUT.items():
        os.makedirs(dest / "pkg" / Path(target).parent, exist_ok=True)
        os.rename(src / folder, dest / "pkg" / target)


def one(pythonpath: str | None, data: Path) -> dict[str, list]:  # type: ignore[type-arg]
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run([sys.executable, "-c", RUN, str(data)], check=True, capture_output=True, text=True,
                         env=env, cwd=tempfile.gettempdir())
    got = json.loads(out.stdout)
    # the tree asked for, not the installed one
    assert got["module"].startswith(pythonpath or str(ROOT)), (got["module"], pythonpath)
    return got["runs"]  # type: ignore[no-any-return]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--other-rev", default="HEAD")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="isb-") as d:
        tmp = Path(d)
        lay_out(args.other_rev, tmp)
        data = tmp / "texts.json"
        data.write_text(json.dumps(texts()))
        trees = {"this tree": "", args.other_rev: str(tmp / "pkg")}  # "": the installed (editable) package
        secs: dict[str, dict[str, list[float]]] = {t: {} for t in trees}
        found: dict[str, dict[str, list]] = {t: {} for t in trees}  # type: ignore[type-arg]
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for tree in order:
                for name, (s, f) in one(trees[tree] or None, data).items():
                    secs[tree].setdefault(name, []).append(s)
                    found[tree][name] = f
    this, other = list(trees)
    for name in texts():
        a, b = statistics.median(secs[this][name]), statistics.median(secs[other][name])
        same = found[this][name] == found[other][name]
        print(f"{name:30} this tree {a:7.3f} s   {other} {b:7.3f} s   ratio {a / b:5.2f}   "
              f"findings {len(found[this][name])} {'same' if same else 'DIFFER'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
