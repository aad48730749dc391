#!/usr/bin/env bash
# The one-command GPU check (issues 3, 4 and 5). On a machine with an NVIDIA GPU and torch:
#
#   bash bench/gpu_check.sh 2>&1 | tee gpu_check.log
#
# 1. cold start: cuda_init and weights_to_device spans, cuda_init nested, one graph_capture (gpu_check_coldstart.sh)
# 2. OOM classes forced for real: capacity, fragmentation, reservation conflict by another
#    tenant and by set_per_process_memory_fraction, with infersight's verdicts (gpu_check_oom.py)
# 3. `infersight baseline --json` on every visible GPU, and one NVML sample per device
# 4. engines' own memory errors forced for real (JAX/XLA, ONNX Runtime's CUDA arena where it has one),
#    classified live under `launch` and as text (gpu_check_engines.py; issue 24)
# 5. OOM to classified record in the file with real CUDA OOMs (oom_latency.py --real; budget 100 ms)
# 6. a neighbour computing on cuda:0: NVML's per-process SM use, and the other_process cause (gpu_check_neighbour.py)
#
# GPU_CHECK_OUT=DIR keeps part 4's stderr and verdicts (the real messages) in DIR/engines.json.
#
# On the lent H200 (no registry): build the wheels here (infersight and the agent's dependencies that
# its image lacks) into .whl/, then run in one command, carrying .whl:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
#   PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH GPU_CHECK_OUT=$OUT bash bench/gpu_check.sh
#
# Where infersight is not pip-installed (the lent H200 has no registry), the script imports it
# from this checkout through a temporary namespace tree; the OTel/aiomqtt wheels are only
# needed for `launch` mode, and the cold-start part falls back to the hooks' spool without them.
# Exit status: 0 when every part passed.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
PY=${PYTHON:-python3}
# This checkout's ./infersight holds only the top-level modules (agent/, hooks/... sit beside it):
# with the repository root as the working directory, `python -c`, `-m` and `-` would put it first on
# sys.path and hide the installed package. Python >= 3.11 leaves the working directory off.
export PYTHONSAFEPATH=1
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
if ! "$PY" -c 'import infersight.agent.devices.nvml' 2>/dev/null; then
  mkdir -p "$tree/infersight"
  cp infersight/__init__.py infersight/__main__.py "$tree/infersight/"
  for d in agent hooks exporters rules; do ln -s "$root/$d" "$tree/infersight/$d"; done
  export PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}"
  echo "gpu_check: infersight imported from this checkout ($tree)"
fi
rc=0

echo "== 1. cold start (cuda_init, weights_to_device)"
timeout 300 bash bench/gpu_check_coldstart.sh || rc=1

echo "== 2. OOM classes forced on the device"
timeout 300 "$PY" bench/gpu_check_oom.py || rc=1

echo "== 3a. NVML: one sample per device"
timeout 60 "$PY" - <<'PYEOF' || rc=1
import dataclasses, json
from infersight.agent.devices.nvml import Nvml
nv = Nvml()
st = nv.status()
print(json.dumps(dataclasses.asdict(st)))
assert st.available, st.reason
for s in nv.sample_all():
    d = dataclasses.asdict(s)
    d.pop("processes", None)
    print(json.dumps({k: v for k, v in d.items() if v is not None}))
PYEOF

echo "== 3b. infersight baseline --json"
timeout 300 "$PY" -m infersight baseline --json || rc=1

echo "== 4. engines' memory errors forced on the device"
timeout 400 "$PY" bench/gpu_check_engines.py ${GPU_CHECK_OUT:+--out "$GPU_CHECK_OUT/engines.json"} || rc=1

echo "== 5. OOM to classified record, real CUDA OOMs"
timeout 180 "$PY" bench/oom_latency.py --real --n 30 || rc=1

echo "== 6. another process computing on the device (other_process)"
timeout 180 "$PY" bench/gpu_check_neighbour.py || rc=1

echo "gpu_check: $([ $rc -eq 0 ] && echo PASS || echo FAIL)"
exit $rc
