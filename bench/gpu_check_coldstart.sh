#!/usr/bin/env bash
# GPU check for the cold-start hooks (issue 3): one command on a GPU machine with torch.
#
#   bash bench/gpu_check_coldstart.sh  # from the repository root (bench/gpu_check.sh runs it)
#
# Runs tests/support/workloads/coldstart_gpu.py (CUDA first touched by model.to("cuda")) with
# the hooks and prints every cold-start span, then checks that cuda_init and
# weights_to_device were found, cuda_init nested inside weights_to_device, and that the
# CUDA graph captured with torch.cuda.graph is one graph_capture span (one graph).
# With the infersight CLI installed it runs under `infersight launch` and `infersight
# show`; without it (only torch there) it loads the hooks straight from hooks/bootstrap,
# lets them spool to a directory (no agent), and decodes the spool with the stdlib.
# Exit status: 0 when these stages are present (and nested), 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PYTHONWARNINGS=ignore

"$PY" -c 'import torch, sys; ok = torch.cuda.is_available(); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", ok); sys.exit(0 if ok else 3)' \
  || { echo "gpu_check: no CUDA device visible to torch" >&2; exit 1; }

if command -v infersight >/dev/null 2>&1 && "$PY" -c 'import infersight.agent.commands.launch' 2>/dev/null; then
  echo "gpu_check: mode launch"
  INFERSIGHT_MEASURE_STORAGE=1 infersight launch --otlp-file "$work/gpu.otlp.jsonl" -- \
    "$PY" tests/support/workloads/coldstart_gpu.py "$work"
  infersight show "$work/gpu.otlp.jsonl" || true
  source_kind=otlp
  source_path="$work/gpu.otlp.jsonl"
else
  echo "gpu_check: mode spool (infersight CLI not installed; hooks from $root/hooks/bootstrap)"
  mkdir -p "$work/spool"
  env PYTHONPATH="$root/hooks/bootstrap${PYTHONPATH:+:$PYTHONPATH}" \
      INFERSIGHT_SOCKET="$work/no-agent.sock" INFERSIGHT_SPOOL_DIR="$work/spool" \
      INFERSIGHT_EXIT_FLUSH_S=0 \
      "$PY" tests/support/workloads/coldstart_gpu.py "$work"
  source_kind=spool
  source_path="$work/spool"
fi

"$PY" - "$source_kind" "$source_path" <<'PYEOF'
import glob, json, os, struct, sys

kind, path = sys.argv[1], sys.argv[2]
spans = []  # (name, id, parent, start, end, attrs)
if kind == "otlp":
    def val(v):
        for k in ("stringValue", "boolValue", "intValue", "doubleValue"):
            if k in v:
                return v[k]
        return None
    for line in open(path):
        for rs in json.loads(line).get("resourceSpans", []):
            for ss in rs["scopeSpans"]:
                for s in ss["spans"]:
                    a = {kv["key"]: val(kv["value"]) for kv in s.get("attributes", [])}
                    spans.append((s["name"], s["spanId"], s.get("parentSpanId"), int(s["startTimeUnixNano"]),
                                  int(s["endTimeUnixNano"]), a))
else:
    for f in glob.glob(os.path.join(path, "*.spool")):
        data = open(f, "rb").read()
        pos = 0
        while pos + 4 <= len(data):
            (n,) = struct.unpack_from("!I", data, pos)
            msg = json.loads(data[pos + 4:pos + 4 + n])
            pos += 4 + n
            for _seq, t_ns, k, d in msg.get("e", []) if msg.get("t") == "b" else []:
                if k == "span":
                    spans.append((d["n"], d["id"], d.get("p"), d["s"], d.get("e", t_ns), d.get("a", {})))
roots = [s for s in spans if s[0] == "coldstart"]
if not roots:
    sys.exit("gpu_check: no coldstart root found")
root = max(roots, key=lambda s: s[4] - s[3])
print("\ngpu_check: spans of the cold start (%.3f s)" % ((root[4] - root[3]) / 1e9))
print("%-28s %9s %9s  %s" % ("span", "start s", "dur s", "attributes"))
for s in sorted(spans, key=lambda s: s[3]):
    if s[0].startswith("coldstart"):
        keep = {k: v for k, v in s[5].items() if k.startswith(("infersight.weights", "infersight.cuda",
                                                               "infersight.capture"))}
        print("%-28s %9.3f %9.3f  %s" % (s[0], (s[3] - root[3]) / 1e9, (s[4] - s[3]) / 1e9, json.dumps(keep)))
by_id = {s[1]: s for s in spans}
cuda = [s for s in spans if s[0] == "coldstart.cuda_init"]
dev = [s for s in spans if s[0] == "coldstart.weights_to_device"]
ok = True
if not cuda:
    print("gpu_check: FAIL no cuda_init span"); ok = False
if not dev:
    print("gpu_check: FAIL no weights_to_device span"); ok = False
if cuda and dev:
    nested = any(c[2] == d[1] for c in cuda for d in dev)
    print("gpu_check: cuda_init %.3f s, %s weights_to_device" % ((cuda[0][4] - cuda[0][3]) / 1e9,
                                                             "nested inside" if nested else "NOT nested inside"))
    for d in dev:
        a = d[5]
        print("gpu_check: weights_to_device %.3f s, %s bytes, %.0f MiB/s to %s" % (
            (d[4] - d[3]) / 1e9, a.get("infersight.weights.bytes"),
            float(a.get("infersight.weights.bytes_per_s") or 0) / 2**20, a.get("infersight.weights.device")))
    ok = ok and nested
captures = [s for s in spans if s[0] == "coldstart.graph_capture"]
if len(captures) != 1:
    print("gpu_check: FAIL %d graph_capture spans (expected 1)" % len(captures)); ok = False
else:
    c = captures[0]
    graphs = int(c[5].get("infersight.capture.graphs") or 0)
    print("gpu_check: graph_capture %.3f s, %d graph(s), api %s" % (
        (c[4] - c[3]) / 1e9, graphs, c[5].get("infersight.capture.api")))
    if graphs != 1 or c[5].get("infersight.capture.api") != "torch.cuda.graph":
        print("gpu_check: FAIL graph_capture attributes"); ok = False
print("gpu_check: %s" % ("PASS" if ok else "FAIL"))
sys.exit(0 if ok else 1)
PYEOF
