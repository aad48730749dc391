"""What the hooks add to a real cold start, in instructions (callgrind): a measure that the
load and the speed of a shared machine do not move.

    python bench/hooks_instructions.py [--other-hooks BOOTSTRAP_DIR] [--scale 70]

The workload is the cold start of ``bench/launch_overhead.py`` without its fixed matmuls:
``import torch``, ``BertModel.from_pretrained`` of a small BERT made here from a config, one
forward. It runs under ``valgrind --tool=callgrind --separate-threads=yes`` plain and with the
hooks (the bootstrap on PYTHONPATH, no agent: they spool), and with ``--other-hooks`` another
tree's hooks too. Printed per variant: the main thread's instructions (the hooks' in-line
cost: the import finder, stage and weights wrappers) and the hooks' own threads' (sampler,
drain), each against plain's total.

Under valgrind a program runs ``--scale`` times slower (measured: wall under valgrind / wall
plain, printed), so every timer of the hooks fires that much more often per instruction of
the workload. The sampler's interval and the batch delay are stretched by ``--scale`` to
match; the hooks' other timers (the tick, checkpoints, ack waits) are not configurable, so the
threads' figure is an upper bound of what they cost at full speed. The main thread's figure
does not depend on timers. Wall time and CPU time are not measured here (``launch_overhead``).
Each variant takes 4-8 minutes on a 2-core machine. Needs valgrind.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

WORKLOAD = r"""
import sys
import torch
from transformers import BertModel
torch.set_num_threads(1)
model = BertModel.from_pretrained(sys.argv[1])
with torch.no_grad():
    model(torch.ones(1, 32, dtype=torch.long))
"""

MAKE_MODEL = r"""
import sys
from transformers import BertConfig, BertModel
BertModel(BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                     vocab_size=8000)).save_pretrained(sys.argv[1])
"""


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("INFERSIGHT", "OTEL_EXPORTER_OTLP")) and k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONHASHSEED="0", PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1",
               TQDM_DISABLE="1", INFERSIGHT_MEASURE_STORAGE="0")
    return env


def threads(out_prefix: str) -> list[int]:
    """Instructions per thread (callgrind's ``-NN`` files, in thread order)."""
    d = os.path.dirname(out_prefix)
    name = os.path.basename(out_prefix)
    counts = []
    for f in sorted(x for x in os.listdir(d) if x.startswith(name + "-")):
        with open(os.path.join(d, f)) as fh:
            for line in fh:
                m = re.match(r"summary: (\d+)", line)
                if m:
                    counts.append(int(m.group(1)))
                    break
    return counts


def run(tmp: str, label: str, script: str, model: str, env: dict[str, str]) -> list[int]:
    out = os.path.join(tmp, "cg_" + label)
    subprocess.run(["valgrind", "--tool=callgrind", "--separate-threads=yes", "--callgrind-out-file=" + out,
                    sys.executable, script, model], env=env, check=True, capture_output=True)
    return threads(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other-hooks", metavar="BOOTSTRAP_DIR", help="another tree's hooks (its hooks/bootstrap)")
    ap.add_argument("--scale", type=float, default=0.0, help="valgrind's slowdown (0: measure it)")
    args = ap.parse_args()
    from infersight.agent.commands.launch import bootstrap_dir

    tmp = tempfile.mkdtemp(prefix="hooks-instr-")
    script = os.path.join(tmp, "workload.py")
    with open(script, "w") as f:
        f.write(WORKLOAD)
    model = os.path.join(tmp, "model")
    subprocess.run([sys.executable, "-c", MAKE_MODEL, model], check=True, capture_output=True, env=base_env())
    env = base_env()
    t0 = time.perf_counter()
    subprocess.run([sys.executable, script, model], check=True, capture_output=True, env=env)
    native_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    plain = run(tmp, "plain", script, model, env)
    scale = args.scale or (time.perf_counter() - t0) / native_s
    print("valgrind slowdown %.0fx (plain %.2f s natively); timers stretched by it" % (scale, native_s))
    hooked = {"PYTHONPATH": "", "INFERSIGHT_SOCKET": os.path.join(tmp, "absent.sock"),
              "INFERSIGHT_SAMPLER_INTERVAL_MS": "%.0f" % (10 * scale),
              "INFERSIGHT_BATCH_DELAY_MS": "%.0f" % (50 * scale)}
    variants = [("hooks", bootstrap_dir())]
    if args.other_hooks:
        variants.append(("other hooks", args.other_hooks))
    total = sum(plain)
    print("%-12s %16s %16s %9s %9s %9s" % ("variant", "main thread", "other threads", "main +%", "threads %",
                                           "total +%"))
    print("%-12s %16d %16d" % ("plain", plain[0], sum(plain[1:])))
    for i, (label, boot) in enumerate(variants):
        e = {**env, **hooked, "PYTHONPATH": boot, "INFERSIGHT_SPOOL_DIR": os.path.join(tmp, "spool%d" % i)}
        got = run(tmp, "v%d" % i, script, model, e)
        extra_threads = sum(got[1:]) - sum(plain[1:])
        print("%-12s %16d %16d %8.2f%% %8.2f%% %8.2f%%" % (
            label, got[0], sum(got[1:]), 100.0 * (got[0] - plain[0]) / total, 100.0 * extra_threads / total,
            100.0 * (sum(got) - total) / total))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
