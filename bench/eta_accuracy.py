"""How good is the cold-start ETA? Same real workload, six runs, then a look at the sixth.

The workload is a transformers BERT (built from a config with random weights, saved with
``save_pretrained``) behind FastAPI + uvicorn, served under a real ``infersight agent``.
Runs 1-5 build the history. In run 6 the bench polls ``status --json`` every 50 ms; once the
run is over and its real total T is known, it takes the ETA published nearest to 25%, 50%
and 75% of T and compares it with the real time left. Target: median absolute error at
most 20% of the remaining time.

Then the weights are evicted from the page cache (``posix_fadvise(DONTNEED)``) and a cold
run is predicted twice: from the warm history (the cache state does not match; all runs are
used) and from cold history (three cold runs first). The gap between the two is why the
cache state is part of what history is matched on.

    python bench/eta_accuracy.py            # about 2 minutes on a 2-core VM
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PREPARE = r"""
import sys
from transformers import BertConfig, BertModel
cfg = BertConfig(vocab_size=30522, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                 intermediate_size=2048)
BertModel(cfg).save_pretrained(sys.argv[1])
"""

SERVE = r"""
import os, sys
import torch
from fastapi import FastAPI
from transformers import AutoModel
import uvicorn

model = AutoModel.from_pretrained(os.environ["MODEL_DIR"]).eval()
with torch.no_grad():
    model(input_ids=torch.ones(1, 16, dtype=torch.long))
app = FastAPI()

@app.get("/embed")
def embed() -> dict:
    with torch.no_grad():
        out = model(input_ids=torch.ones(1, 16, dtype=torch.long))
    return {"dim": int(out.last_hidden_state.shape[-1])}

uvicorn.run(app, host="127.0.0.1", port=int(os.environ["PORT"]), log_level="warning")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def evict(directory: str) -> int:
    n = 0
    for root, _dirs, files in os.walk(directory):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return n


def status(sock: str) -> dict:  # type: ignore[type-arg]
    from infersight.agent.commands.status import query_status

    try:
        return query_status(sock, 1.0)
    except OSError:
        return {}


class Bench:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.sock = str(root / "agent.sock")
        self.model = str(root / "model")
        self.script = root / "serve.py"
        self.script.write_text(SERVE)
        self.state = root / "state"
        self.agent: subprocess.Popen[bytes] | None = None

    def start_agent(self, state: Path) -> None:
        conf = self.root / "agent.toml"
        conf.write_text('[agent]\nsocket = "%s"\nspool_dir = "%s"\n[exporters.file]\npath = "%s"\n'
                        % (self.sock, self.root / "spool", self.root / "out.otlp.jsonl"))
        env = {**os.environ, "INFERSIGHT_STATE_DIR": str(state)}
        self.agent = subprocess.Popen([sys.executable, "-m", "infersight", "agent", "--config", str(conf)],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while not status(self.sock).get("healthy"):
            if time.monotonic() > deadline:
                raise SystemExit("agent did not start")
            time.sleep(0.1)

    def stop_agent(self) -> None:
        if self.agent is not None:
            self.agent.send_signal(signal.SIGTERM)
            self.agent.wait(30)
            self.agent = None

    def run(self, watch: bool = False) -> tuple[float, list[tuple[float, float | None]]]:
        """One cold start: spawn, wait until it answers, one request, stop. Returns (T, samples)."""
        port = free_port()
        env = {**os.environ, "INFERSIGHT_SOCKET": self.sock, "INFERSIGHT_SPOOL_DIR": str(self.root / "spool"),
               "PYTHONPATH": str(REPO / "hooks" / "bootstrap"), "MODEL_DIR": self.model, "PORT": str(port),
               "OTEL_SERVICE_NAME": "eta-bench", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, str(self.script)], env=env)
        samples: list[tuple[float, float | None]] = []
        while True:
            if watch:
                rows = [c for c in status(self.sock).get("coldstarts", []) if c["pid"] == proc.pid]
                if rows:
                    samples.append((time.monotonic() - t0, rows[0]["eta_s"]))
            try:
                with urllib.request.urlopen("http://127.0.0.1:%d/embed" % port, timeout=2) as r:
                    r.read()
                break
            except OSError:
                if proc.poll() is not None:
                    raise SystemExit("workload died") from None
                time.sleep(0.05)
        total = time.monotonic() - t0
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        time.sleep(0.5)  # the agent records the run
        return total, samples


def errors_at(total: float, samples: list[tuple[float, float | None]]) -> list[tuple[float, float, float, float]]:
    """(share, eta, actual left, relative error) at 25/50/75% of the real cold start."""
    out = []
    for share in (0.25, 0.5, 0.75):
        at = share * total
        usable = [(t, e) for t, e in samples if e is not None]
        if not usable:
            continue
        t, eta = min(usable, key=lambda s: abs(s[0] - at))
        left = total - t
        out.append((t / total, eta, left, abs(eta - left) / left if left > 0 else 0.0))
    return out


def report(title: str, total: float, samples: list[tuple[float, float | None]]) -> float | None:
    rows = errors_at(total, samples)
    print("%s: cold start %.2f s" % (title, total))
    for share, eta, left, err in rows:
        print("  at %3.0f%%: ETA %5.2f s, actually %5.2f s left, error %4.0f%%" % (100 * share, eta, left, 100 * err))
    if not rows:
        print("  no ETA was published")
        return None
    med = statistics.median(r[3] for r in rows)
    print("  median absolute error: %.0f%% of the remaining time" % (100 * med))
    return med


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="eta-bench-"))
    try:
        subprocess.run([sys.executable, "-c", PREPARE, str(root / "model")], check=True,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
        b = Bench(root)
        b.start_agent(root / "state-warm")
        for i in range(5):
            total, _ = b.run()
            print("history run %d: %.2f s" % (i + 1, total))
        total, samples = b.run(watch=True)
        warm_err = report("run 6 (warm cache, 5 runs of history)", total, samples)
        print("evicted %d bytes of weights" % evict(b.model))
        total, samples = b.run(watch=True)
        report("cold run predicted from warm history", total, samples)
        b.stop_agent()
        b.start_agent(root / "state-cold")
        for i in range(3):
            evict(b.model)
            total, _ = b.run()
            print("cold history run %d: %.2f s" % (i + 1, total))
        evict(b.model)
        total, samples = b.run(watch=True)
        report("cold run predicted from cold history", total, samples)
        b.stop_agent()
        if warm_err is not None:
            print("target: median error <= 20%%: %s" % ("met" if warm_err <= 0.2 else "MISSED"))
        hist = root / "state-warm" / "coldstart-history.jsonl"
        if hist.exists():
            print("history lines: %d" % len(hist.read_text().splitlines()))
            print("last run stages: %s" % json.loads(hist.read_text().splitlines()[-1])["stages"])
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
