"""GPU check for issue 24: engines' own memory errors, forced for real, classified live and as text.

    python bench/gpu_check_engines.py [--out FILE]  # on a machine with an NVIDIA GPU and JAX
    python bench/gpu_check_engines.py --dry-run     # the plan; needs neither JAX nor a GPU

Each scenario runs a small program in its own process that makes an engine raise its own memory
error on the device: JAX/XLA (``RESOURCE_EXHAUSTED``) and, where onnxruntime has the CUDA
execution provider, ONNX Runtime's BFC arena. With the ``infersight`` CLI installed, the program
runs under ``infersight launch --otlp-file`` (the embedded agent, real NVML), so the error is
classified live from the child's stderr, as an operator would see it; the whole stderr is also
classified as text (``infersight classify --json``, no NVML), as a pasted log would be.

Scenarios (T = the device's total, from NVML):

- xla_capacity: preallocation off; one buffer of T + 1 GiB (more than the device);
- xla_fraction: ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.10`` (JAX preallocates 10% of T); one buffer
  of 0.20 x T: the device has it free, the engine's reservation does not;
- xla_tenant: another process (PyTorch) holds 0.90 x T; JAX, preallocation off, asks for
  0.20 x T;
- ort_arena: ``gpu_mem_limit`` 256 MiB on the CUDA execution provider; a MatMul whose output
  needs 1 GiB (skipped when onnxruntime has no CUDA provider);
- torch_uncaught: PyTorch asks for T + 1 GiB and does not catch the error: the hooks' allocator observer,
  their exception hook and launch's copy of stderr each see it, and one record must come out.

Expected live: capacity for the first and the last; reservation conflict for the others (NVML shows the device
free, or the tenant). As text, where the text alone does not carry the device's total, ``unknown`` with a reason
is accepted too (the rubric: no confident class without evidence). Each scenario's whole stderr
and verdicts go to FILE (JSON) so that the real messages can be kept as examples. Exit status 0
when every verdict that ran is accepted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GIB = 1 << 30
MIB = 1 << 20

JAX_ALLOC = r"""
import sys, time
import jax, jax.numpy as jnp
n = int(sys.argv[1])
print("jax", jax.__version__, jax.devices(), file=sys.stderr, flush=True)
x = jnp.zeros((n,), dtype=jnp.uint8)
x.block_until_ready()
print("no OOM: %d bytes allocated" % n, file=sys.stderr, flush=True)
"""

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpu_check.sh sets PYTHONSAFEPATH
from gpu_check_oom import HOLDER  # noqa: E402  (another tenant: holds a share of the device until stdin closes)

ORT_ARENA = r"""
import sys
import numpy as np
import onnx
from onnx import TensorProto, helper
import onnxruntime as ort
print("onnxruntime", ort.__version__, ort.get_available_providers(), file=sys.stderr, flush=True)
n = 16384  # a (n x n) float32 output: 1 GiB
a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [n, 1])
b = helper.make_tensor_value_info("b", TensorProto.FLOAT, [1, n])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, n])
g = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"])], "oom", [a, b], [y])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
m.ir_version = 8
prov = [("CUDAExecutionProvider", {"gpu_mem_limit": str(256 << 20), "arena_extend_strategy": "kNextPowerOfTwo"})]
s = ort.InferenceSession(m.SerializeToString(), providers=prov)
s.run(None, {"a": np.ones((n, 1), np.float32), "b": np.ones((1, n), np.float32)})
print("no OOM", file=sys.stderr, flush=True)
"""

TORCH_UNCAUGHT = r"""
import sys, torch
n = int(sys.argv[1])
print("torch", torch.__version__, file=sys.stderr, flush=True)
torch.empty(n, dtype=torch.uint8, device="cuda")  # uncaught: the observer, the exception hook and stderr all see it
"""

ACCEPT: dict[str, dict[str, tuple[str, ...]]] = {
    "xla_capacity": {"live": ("capacity",), "text": ("capacity", "unknown")},
    "xla_fraction": {"live": ("reservation_conflict",), "text": ("reservation_conflict", "unknown")},
    "xla_tenant": {"live": ("reservation_conflict",), "text": ("reservation_conflict", "unknown")},
    "ort_arena": {"live": ("reservation_conflict",), "text": ("reservation_conflict", "unknown")},
    "torch_uncaught": {"live": ("capacity",), "text": ("capacity",)},
}
PLAN = {
    "xla_capacity": "JAX, preallocation off: one buffer of T + 1 GiB",
    "xla_fraction": "JAX, XLA_PYTHON_CLIENT_MEM_FRACTION=0.10: one buffer of 0.20 x T",
    "xla_tenant": "PyTorch holds 0.90 x T; JAX, preallocation off: one buffer of 0.20 x T",
    "ort_arena": "ONNX Runtime CUDA EP, gpu_mem_limit 256 MiB: a MatMul with a 1 GiB output",
    "torch_uncaught": "PyTorch, uncaught: T + 1 GiB (hooks' observer, exception hook and stderr: one record)",
}


def device_total() -> int:
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
    finally:
        pynvml.nvmlShutdown()


def ort_has_cuda() -> bool:
    try:
        import onnxruntime

        return "CUDAExecutionProvider" in onnxruntime.get_available_providers()
    except Exception:
        return False


def _val(v: dict[str, Any]) -> Any:
    for k in ("stringValue", "boolValue", "intValue", "doubleValue"):
        if k in v:
            return v[k]
    return None


def live_verdicts(otlp: Path) -> list[dict[str, Any]]:
    """The classified OOM log records of launch's OTLP file."""
    out: list[dict[str, Any]] = []
    if not otlp.exists():
        return out
    for line in otlp.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        for rl in json.loads(line).get("resourceLogs", []):
            for sl in rl.get("scopeLogs", []):
                for r in sl.get("logRecords", []):
                    if r.get("eventName") != "oom":
                        continue
                    a = {kv["key"]: _val(kv["value"]) for kv in r.get("attributes", [])}
                    out.append(
                        {
                            "class": a.get("infersight.oom.class"),
                            "engine": a.get("infersight.oom.engine"),
                            "rule": a.get("infersight.oom.rule"),
                            "nvml": a.get("infersight.oom.nvml"),
                            "reason": a.get("infersight.oom.reason"),
                            "numbers": {k: v for k, v in a.items() if k.endswith("_bytes")},
                            "body": str(_val(r.get("body", {})) or "")[:600],
                        }
                    )
    return out


def text_verdicts(stderr: str) -> list[dict[str, Any]]:
    p = subprocess.run(
        [sys.executable, "-m", "infersight", "classify", "--json", "-"],
        input=stderr,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = []
    for line in p.stdout.splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        out.append({k: d.get(k) for k in ("class", "engine", "rule", "reason", "numbers")})
    if not out:
        out.append({"class": "none", "rule": (p.stdout + p.stderr).strip()[:300]})
    return out


def run_program(
    name: str, prog: str, args: list[str], env: dict[str, str], work: Path, launch: bool
) -> tuple[int, str, list[dict[str, Any]]]:
    src = work / (name + ".py")
    src.write_text(prog, encoding="utf-8")
    otlp = work / (name + ".otlp.jsonl")
    cmd = [sys.executable, str(src), *args]
    if launch:
        cmd = [sys.executable, "-m", "infersight", "launch", "--otlp-file", str(otlp), "--", *cmd]
    p = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=240, check=False)
    return p.returncode, p.stderr, live_verdicts(otlp)


def run_scenario(name: str, total: int, work: Path, launch: bool) -> dict[str, Any]:
    env = {"PYTHONUNBUFFERED": "1"}
    holder = None
    res: dict[str, Any] = {"scenario": name, "plan": PLAN[name], "total": total}
    try:
        if name == "xla_capacity":
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
            rc, err, live = run_program(name, JAX_ALLOC, [str(total + GIB)], env, work, launch)
        elif name == "xla_fraction":
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.10"
            rc, err, live = run_program(name, JAX_ALLOC, [str(int(0.20 * total))], env, work, launch)
        elif name == "xla_tenant":
            holder = subprocess.Popen(
                [sys.executable, "-c", HOLDER, "0.90"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            line = holder.stdout.readline() if holder.stdout else ""
            if line.strip() != "ready":
                raise RuntimeError("the other tenant could not take its memory")
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
            rc, err, live = run_program(name, JAX_ALLOC, [str(int(0.20 * total))], env, work, launch)
        elif name == "torch_uncaught":
            rc, err, live = run_program(name, TORCH_UNCAUGHT, [str(total + GIB)], env, work, launch)
        else:
            rc, err, live = run_program(name, ORT_ARENA, [], env, work, launch)
    finally:
        if holder is not None:
            if holder.stdin:
                holder.stdin.close()
            holder.wait(60)
    res.update(rc=rc, stderr=err[-200_000:], live=live, text=text_verdicts(err))
    return res


def judge(res: dict[str, Any], launch: bool) -> list[str]:
    """What failed in one scenario's verdicts (empty: accepted)."""
    fails = []
    acc = ACCEPT[res["scenario"]]
    if res["rc"] == 0:
        return ["the program did not fail (no OOM forced)"]
    text = [v["class"] for v in res["text"]]
    if not any(c in acc["text"] for c in text):
        fails.append("text: %s, expected one of %s" % (text, acc["text"]))
    if launch:
        live = [v["class"] for v in res["live"]]
        if len(live) != 1:
            fails.append("live: %d OOM records, expected 1 (%s)" % (len(live), live))
        elif live[0] not in acc["live"]:
            fails.append("live: %s, expected %s" % (live[0], acc["live"]))
    return fails


def main() -> int:
    ap = argparse.ArgumentParser(description="force engines' memory errors on a GPU and print infersight's verdicts")
    ap.add_argument("--dry-run", action="store_true", help="print the plan only")
    ap.add_argument("--out", type=Path, help="write each scenario's stderr and verdicts here (JSON)")
    ap.add_argument("--scenario", action="append", choices=sorted(PLAN), help="run only these")
    args = ap.parse_args()
    if args.dry_run:
        print("gpu_check_engines plan (each scenario in its own process):")
        for s, plan in PLAN.items():
            print(
                "  %-13s live %-22s text %-36s %s" % (s, "/".join(ACCEPT[s]["live"]), "/".join(ACCEPT[s]["text"]), plan)
            )
        return 0
    work = Path(tempfile.mkdtemp(prefix="gpu-engines-"))
    launch = shutil.which("infersight") is not None or _has_launch()
    total = device_total()
    print("gpu_check_engines: device total %.1f GiB, mode %s" % (total / GIB, "launch" if launch else "text only"))
    names = args.scenario or list(PLAN)
    rc = 0
    results = []
    for name in names:
        if name == "ort_arena" and not ort_has_cuda():
            print("  %-13s SKIP onnxruntime has no CUDAExecutionProvider here" % name)
            continue
        t0 = time.monotonic()
        try:
            res = run_scenario(name, total, work, launch)
        except Exception as exc:  # one broken scenario must not hide the others
            print("  %-13s FAIL %s: %s" % (name, type(exc).__name__, exc))
            rc = 1
            continue
        res["seconds"] = round(time.monotonic() - t0, 1)
        fails = judge(res, launch)
        res["fails"] = fails
        results.append(res)
        live = ", ".join("%s/%s/%s" % (v["class"], v["engine"], v["rule"]) for v in res["live"]) or "-"
        text = ", ".join("%s/%s/%s" % (v["class"], v.get("engine"), v.get("rule")) for v in res["text"])
        print(
            "  %-13s %s live [%s] text [%s] (%.0f s)"
            % (name, "ok  " if not fails else "FAIL", live, text, res["seconds"])
        )
        for f in fails:
            print("      " + f)
        if fails:
            rc = 1
            print("      stderr tail: " + res["stderr"][-600:].replace("\n", "\n      "))
    shutil.rmtree(work, ignore_errors=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1), encoding="utf-8")
    print("gpu_check_engines: %s" % ("PASS" if rc == 0 else "FAIL"))
    return rc


def _has_launch() -> bool:
    try:
        import infersight.agent.commands.launch  # noqa: F401

        return True
    except Exception:
        return False


if __name__ == "__main__":
    sys.exit(main())
