"""The live context of an engine's memory error (rules/serving_context.py, agent/oom/engine_context.py).

The findings come from real engine messages (tests/support/data, each with its thread) run
through the real rules; the context is built by hand (pure function) or read from a fake
/proc tree and a FAKE NVML (a stand-in for absent hardware, returning the devices feature's
real DeviceSample values).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from infersight.agent.daemon.assemble import Assembler, Producer
from infersight.agent.devices.nvml import DeviceSample, GpuProcess
from infersight.agent.oom import engine_context
from infersight.agent.oom.kind import OomClassifier, OomHandlers
from infersight.rules.serving import Finding, analyse
from infersight.rules.serving_context import (
    DEVICE_SHORTAGE_RULES,
    MAX_ARG_CHARS,
    DeviceContext,
    LiveContext,
    Tenant,
    material_bytes,
    names_other_accelerator,
    parse_knobs,
    refine,
)
from infersight.telemetry import LogItem, Resource

GIB = 1 << 30
DATA = Path(__file__).resolve().parents[1] / "support" / "data"
SERVING = OomClassifier([]).serving


def _record(rid: str) -> str:
    for path in sorted(DATA.glob("serving_ooms_*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            d = json.loads(line)
            if d.get("id") == rid:
                return str(d["message"])
    raise KeyError(rid)


def _finding(text: str) -> Finding:
    (f, *_) = analyse(text, SERVING)
    assert f.message is None  # an engine's own message, not PyTorch's allocator text
    return f


# c5-006 (vllm-project/vllm, EngineCore): a CUDA driver OOM while vLLM repacked the weights: unknown.
VLLM_LOADING = "c5-006"
# srv-056 (llama.cpp): a compute buffer of 8900 MiB (9332334592 bytes) could not be allocated: unknown.
LLAMA_BUFFER = "srv-056"
# srv-025 (vLLM): free memory below the utilization's share: reservation_conflict from the text.
VLLM_FREE_BELOW = "srv-025"
# srv-053 (llama.cpp): 200 GiB of KV cache asked of one device: capacity from the text.
LLAMA_CAPACITY = "srv-053"
# srv-034 (SGLang): the pool had 5248 tokens for 127: bookkeeping, not a shortage (unknown, not eligible).
SGLANG_BOOKKEEPING = "srv-034"
# SGLang's own raise, the first line of c7-016 (its counts cut): the token pool was full: unknown.
SGLANG_POOL_FULL = "RuntimeError: Prefill out of memory. Try to lower your batch size."


def _dev(total: int = 80 * GIB, own: int = 10 * GIB, others: tuple[Tenant, ...] = ()) -> DeviceContext:
    return DeviceContext("GPU-aaaa", total, own, others)


def _ctx(*devices: DeviceContext, knobs: dict[str, Any] | None = None) -> LiveContext:
    return LiveContext(pid=4242, devices=tuple(devices), nvml=bool(devices), knobs=knobs or {}, knobs_pid=4242)


# -- the pure decision -----------------------------------------------------------------------------


def test_the_eligible_message_is_unknown_without_context() -> None:
    f = _finding(_record(VLLM_LOADING))
    assert f.cls == "unknown" and f.rule in DEVICE_SHORTAGE_RULES and f.engine == "vllm"


def test_another_process_on_the_device_decides_a_reservation_conflict() -> None:
    f = _finding(_record(VLLM_LOADING))
    ctx = _ctx(_dev(own=30 * GIB, others=(Tenant(999, 40 * GIB, "python"),)),
               knobs={"gpu_memory_utilization": 0.9})
    r = refine(f, ctx, SERVING.engine_remedies["vllm"])
    assert r.decided and r.cls == "reservation_conflict"
    assert r.rule == f.rule + "+context.other-process"
    assert r.reason is not None and "pid 999 python (40.00 GiB)" in r.reason
    assert "Move or stop pid 999" in r.remedy and "--gpu-memory-utilization" in r.remedy
    assert "0.50" in r.remedy  # what is left beside the tenant: 40 of 80 GiB
    assert r.attributes["infersight.oom.context.other_pids"] == [999]
    assert r.attributes["infersight.oom.context.other_bytes"] == 40 * GIB
    assert r.attributes["infersight.oom.context.knob.gpu_memory_utilization"] == 0.9
    assert "unknown" in r.note  # says what the message alone gave


def test_a_small_tenant_does_not_decide() -> None:
    """A bare CUDA context (a monitor) is no tenant: 600 MiB < 1 GiB floor; 3 GiB < 5% of 80 GiB."""
    f = _finding(_record(VLLM_LOADING))
    assert material_bytes(80 * GIB) == 4 * GIB and material_bytes(8 * GIB) == GIB
    for used in (600 << 20, 3 * GIB):
        r = refine(f, _ctx(_dev(own=70 * GIB, others=(Tenant(7, used, "dcgm"),))))
        assert not r.decided and r.cls == "unknown"
        assert r.reason is not None and r.reason.startswith(str(f.reason).rstrip(". "))
        assert "pid 7 dcgm" in r.reason and "NVML at the error" in r.reason


def test_a_tenant_decides_nothing_when_the_request_would_not_fit_without_it() -> None:
    f = _finding(_record(LLAMA_BUFFER))  # 8.69 GiB asked
    assert f.cls == "unknown" and f.numbers["R"] == 9332334592
    r = refine(f, _ctx(_dev(total=12 * GIB, own=4 * GIB, others=(Tenant(5, 2 * GIB, "x"),))))
    # 8.69 GiB > 12 - 4: not the tenant's doing; llama.cpp's own weights and KV cache leave too little (capacity)
    assert r.cls == "capacity" and r.rule.endswith("+context.own-buffers-fill-device")
    # under ollama (its own estimate picked the layers) nothing decides
    r = refine(f, LiveContext(pid=1, devices=(_dev(total=12 * GIB, own=4 * GIB, others=(Tenant(5, 2 * GIB, "x"),)),),
                              nvml=True, program="ollama"))
    assert not r.decided and r.cls == "unknown"


def test_a_request_larger_than_the_device_is_capacity() -> None:
    f = _finding(_record(LLAMA_BUFFER))
    r = refine(f, _ctx(_dev(total=8 * GIB, own=7 * GIB)), {"capacity": "ENGINE-CAPACITY"})
    assert r.decided and r.cls == "capacity" and r.rule.endswith("+context.request-exceeds-device")
    assert "8.69 GiB" in str(r.reason) and "8.00 GiB" in str(r.reason)
    assert r.remedy.endswith("ENGINE-CAPACITY")
    # a device larger than the request: no capacity from the context
    assert not refine(f, _ctx(_dev(total=24 * GIB, own=7 * GIB))).decided


XLA_PROGRAM = """jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate \
4770354232 bytes.
BufferAssignment OOM Debugging.
BufferAssignment stats:
             parameter allocation:  372.76MiB
              constant allocation:    48.5KiB
        maybe_live_out allocation:    9.64GiB
     preallocated temp allocation:    4.44GiB
                 total allocation:   14.44GiB"""


def test_an_xla_program_larger_than_the_device_is_capacity() -> None:
    # XLA's buffer assignment prints what the whole program needs; the 4.4 GiB request alone fits either device
    f = _finding(XLA_PROGRAM)
    assert f.rule == "xla.gpu.out-of-memory" and f.cls == "unknown"
    r = refine(f, _ctx(_dev(total=12 * GIB, own=9 * GIB)))
    assert r.decided and r.cls == "capacity" and r.rule.endswith("+context.program-exceeds-device")
    assert "14.44 GiB" in str(r.reason) and "12.00 GiB" in str(r.reason)
    # a device that holds the program: the pool fraction may be what is short, so no class from the context
    assert not refine(f, _ctx(_dev(total=24 * GIB, own=18 * GIB))).decided
    # the program's total alone, without the device's size: still unknown
    assert not refine(f, LiveContext(pid=1)).decided


# Real, JAX 0.11.2 on an H200 (bench/gpu_check_engines.py): XLA_PYTHON_CLIENT_MEM_FRACTION=0.10, then 0.20 of the device
# asked; the scheduler's base limit is the pool's limit (0.10 of the device).
XLA_OVER_POOL = """E1204 17:14:28.461440     938 gpu_hlo_schedule.cc:1068] The byte size of input/output arguments \
(30150964020) exceeds the base limit (15011414016). This indicates an error in the calculation!
W1204 17:14:38.518676     938 bfc_allocator.cc:598] Allocator (GPU_0_bfc) ran out of memory trying to allocate \
28.08GiB (rounded to 30150964224) from the lower end requested by op
jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 28.08GiB with allocator \
GPU_0_bfc on device 0. [executable_name='jit_broadcast_in_dim'] [tf-allocator-allocation-error='']"""


def test_an_xla_request_over_the_pool_limit_is_decided_by_the_device() -> None:
    f = _finding(XLA_OVER_POOL)
    assert f.rule == "xla.gpu.out-of-memory/over-pool-limit" and f.cls == "unknown"
    assert f.numbers["L"] == 15011414016 and "XLA_PYTHON_CLIENT_MEM_FRACTION" in str(f.reason)
    h200 = 150754820096
    # the device holds a full pool and the request, nobody else on it: the fraction fenced the request off
    r = refine(f, _ctx(_dev(total=h200, own=15 * GIB)))
    assert r.decided and r.cls == "reservation_conflict" and r.rule.endswith("+context.pool-below-device")
    assert "about 0.10" in str(r.reason) and "XLA_PYTHON_CLIENT_MEM_FRACTION to 0.30" in r.remedy
    assert r.attributes["infersight.oom.context.fraction_knob"] == "XLA_PYTHON_CLIENT_MEM_FRACTION"
    # a device smaller than the request: capacity, whatever the fraction
    small = refine(f, _ctx(_dev(total=24 * GIB, own=3 * GIB)))
    assert small.decided and small.cls == "capacity" and small.rule.endswith("+context.request-exceeds-device")
    # the request fits the device, but not beside a full pool and what many small processes hold: undecided
    crowd = tuple(Tenant(100 + k, int(2.5 * GIB), "x") for k in range(8))  # 20 GiB, none material (3 GiB on 60)
    assert not refine(f, _ctx(_dev(total=60 * GIB, own=15 * GIB, others=crowd))).decided
    # a material tenant: the tenant decides (reservation), not the fraction
    t = refine(f, _ctx(_dev(total=h200, own=15 * GIB, others=(Tenant(7, 100 * GIB, "python3"),))))
    assert t.cls == "reservation_conflict" and t.rule.endswith("+context.other-process")
    # no device read: still unknown
    assert not refine(f, LiveContext(pid=1)).decided


def test_a_llama_cpp_compute_buffer_that_does_not_fit_beside_its_own_weights_is_capacity() -> None:
    f = _finding(_record(LLAMA_BUFFER))  # 8.69 GiB compute buffer, the free memory after weights and KV not printed
    assert f.rule == "llama.cpp.compute-buffer" and f.cls == "unknown"
    full = _dev(total=24 * GIB, own=20 * GIB)  # weights and KV of this process; 4 GiB left
    r = refine(f, _ctx(full), {"capacity": "ENGINE-CAPACITY"})
    assert r.decided and r.cls == "capacity" and r.rule.endswith("+context.own-buffers-fill-device")
    assert "8.69 GiB" in str(r.reason) and "4.00 GiB" in str(r.reason) and "-ub" in r.remedy
    assert r.remedy.endswith("ENGINE-CAPACITY")
    # room for the buffer at the error (the engine freed its weights, or it was never short): no class
    assert not refine(f, _ctx(_dev(total=24 * GIB, own=12 * GIB))).decided
    # a material tenant: the tenant's rule decides (reservation), not this one
    tenant = refine(f, _ctx(_dev(total=24 * GIB, own=12 * GIB, others=(Tenant(77, 8 * GIB, "python3"),))))
    assert tenant.cls == "reservation_conflict" and tenant.rule.endswith("+context.other-process")
    # many small processes, none material, that hold what the buffer needed: not the engine's own size
    small = tuple(Tenant(100 + k, int(1.1 * GIB), "x") for k in range(9))
    assert not refine(f, _ctx(_dev(total=24 * GIB, own=10 * GIB, others=small))).decided
    # under ollama its tree holds other models' runners, and it picked the layers itself: no class
    under_ollama = LiveContext(pid=1, devices=(full,), nvml=True, program="ollama")
    assert not refine(f, under_ollama).decided
    # ollama started by a shell: its runner holds the memory
    runner = DeviceContext("GPU-aaaa", 24 * GIB, 20 * GIB, (), ("/usr/local/bin/ollama",))
    assert not refine(f, LiveContext(pid=1, devices=(runner,), nvml=True, program="sh")).decided
    # several devices, one with room: which one failed is not known
    assert not refine(f, _ctx(full, _dev(total=24 * GIB, own=6 * GIB))).decided


def test_a_fraction_that_fences_off_an_unshared_device_is_a_reservation() -> None:
    f = _finding(SGLANG_POOL_FULL)
    assert f.engine == "sglang" and f.cls == "unknown" and f.knob == "mem-fraction-static"
    ctx = _ctx(_dev(total=80 * GIB, own=41 * GIB), knobs={"mem_fraction_static": 0.5})
    r = refine(f, ctx)
    assert r.decided and r.cls == "reservation_conflict" and r.rule.endswith("+context.fraction-fences-device")
    assert "--mem-fraction-static 0.5" in str(r.reason) and "Raise --mem-fraction-static" in r.remedy
    assert r.attributes["infersight.oom.context.fraction_knob"] == "mem_fraction_static"
    # the default-like 0.88 leaves 12%: not fenced; nor when the device was full at the error
    assert not refine(f, _ctx(_dev(own=41 * GIB), knobs={"mem_fraction_static": 0.88})).decided
    assert not refine(f, _ctx(_dev(own=75 * GIB), knobs={"mem_fraction_static": 0.5})).decided
    # without NVML nothing says the device was unshared and unused
    assert not refine(f, LiveContext(pid=1, knobs={"mem_fraction_static": 0.5})).decided


def test_the_fraction_rule_needs_the_rules_own_pool_knob() -> None:
    """A generic CUDA OOM under vLLM with a low utilization: the device had room; no class."""
    f = _finding(_record(VLLM_LOADING))
    assert f.knob is None
    r = refine(f, _ctx(_dev(own=40 * GIB), knobs={"gpu_memory_utilization": 0.5}))
    assert not r.decided and r.cls == "unknown"
    assert "--gpu-memory-utilization 0.5" in str(r.reason)


def test_a_message_that_is_no_shortage_is_never_refined() -> None:
    f = _finding(_record(SGLANG_BOOKKEEPING))
    assert f.cls == "unknown" and f.rule not in DEVICE_SHORTAGE_RULES
    r = refine(f, _ctx(_dev(own=30 * GIB, others=(Tenant(9, 40 * GIB, "x"),)), knobs={"mem_fraction_static": 0.5}))
    assert not r.decided and r.cls == "unknown" and "pid 9 x" in str(r.reason)


def test_an_accelerator_nvml_does_not_see_is_never_set_against_nvml() -> None:
    f = _finding("(VllmWorkerProcess pid=270962) ERROR 07-03 19:33:28 [multiproc_worker_utils.py:238] "
                 "RuntimeError: NPU out of memory.")
    assert f.cls == "unknown" and f.rule in DEVICE_SHORTAGE_RULES
    assert not refine(f, _ctx(_dev(own=30 * GIB, others=(Tenant(9, 40 * GIB, "x"),)))).decided
    assert names_other_accelerator("TPU7x HBM") and names_other_accelerator("Vulkan Device memory")
    assert not names_other_accelerator("INPUT and OUTPUT tensors; RELATIONSHIP")


def test_a_class_the_message_decided_is_kept_with_the_context_in_the_note() -> None:
    f = _finding(_record(VLLM_FREE_BELOW))
    assert f.cls == "reservation_conflict"
    r = refine(f, _ctx(_dev(own=GIB), knobs={"gpu_memory_utilization": 0.6}))
    assert (r.cls, r.rule, r.decided) == (f.cls, f.rule, False)
    assert r.note.startswith(f.note) and "live context: NVML at the error" in r.note
    assert "--gpu-memory-utilization 0.6" in r.note
    assert "infersight.oom.context.conflict" not in r.attributes


def test_a_context_that_contradicts_the_message_keeps_the_class_and_says_so() -> None:
    f = _finding(_record(LLAMA_CAPACITY))
    assert f.cls == "capacity"
    r = refine(f, _ctx(_dev(own=20 * GIB, others=(Tenant(31, 50 * GIB, "ollama"),))))
    assert r.cls == "capacity" and not r.decided
    assert "the context conflicts (class kept from the message)" in r.note and "pid 31 ollama" in r.note
    assert "pid 31" in str(r.attributes["infersight.oom.context.conflict"])
    g = _finding(_record(VLLM_FREE_BELOW))  # reservation by the text; nothing in the context says capacity
    assert "infersight.oom.context.conflict" not in refine(g, _ctx(_dev(own=GIB))).attributes


def test_no_context_at_all_changes_nothing() -> None:
    f = _finding(_record(VLLM_LOADING))
    r = refine(f, LiveContext())
    assert (r.cls, r.rule, r.reason, r.remedy, r.note, r.decided) == (f.cls, f.rule, f.reason, f.remedy, f.note,
                                                                         False)
    assert r.attributes == {}


# -- argv --------------------------------------------------------------------------------------------


def test_knobs_in_both_spellings_and_the_underscore_form() -> None:
    argv = ["/usr/bin/python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m",
            "--gpu-memory-utilization", "0.95", "--max_model_len=8192", "--max-num-seqs=64", "--enforce-eager",
            "--tensor-parallel-size", "2"]
    assert parse_knobs(argv) == {"gpu_memory_utilization": 0.95, "max_model_len": 8192, "max_num_seqs": 64,
                                 "enforce_eager": True, "tensor_parallel_size": 2}
    assert parse_knobs(["sglang", "--mem-fraction-static=0.7", "--chunked-prefill-size", "4096"]) == {
        "mem_fraction_static": 0.7, "chunked_prefill_size": 4096}
    assert parse_knobs(["text-generation-launcher", "--cuda-memory-fraction", "0.8",
                        "--max-batch-prefill-tokens", "4096"]) == {"cuda_memory_fraction": 0.8,
                                                                   "max_batch_prefill_tokens": 4096}
    assert parse_knobs(["lmdeploy", "serve", "--cache-max-entry-count", "0.5"]) == {"cache_max_entry_count": 0.5}


def test_llama_short_flags_only_for_llama() -> None:
    assert parse_knobs(["/opt/llama-server", "-ngl", "99", "-c", "4096"]) == {"n_gpu_layers": 99, "ctx_size": 4096}
    assert parse_knobs(["python3", "-c", "4096"]) == {}  # python -c is code, not a context size


def test_bad_values_are_ignored() -> None:
    argv = ["vllm", "--gpu-memory-utilization", "1.5", "--max-model-len", "8k", "--max-num-seqs", "-3",
            "--mem-fraction-static", "nan", "--cuda-memory-fraction=inf", "--num-shard", "2" * 40,
            "--enforce-eager=maybe", "--chunked-prefill-size"]
    assert parse_knobs(argv) == {}
    assert parse_knobs(["vllm", "--gpu-memory-utilization", "0.9", "--gpu-memory-utilization", "x"]) == {
        "gpu_memory_utilization": 0.9}  # the bad one is skipped, the good one stays


def test_a_huge_command_line_is_bounded() -> None:
    junk = ["--x"] * 100_000
    t0 = time.perf_counter()
    assert parse_knobs(["vllm", *junk, "--gpu-memory-utilization", "0.9"]) == {}  # past the bound: unseen
    assert time.perf_counter() - t0 < 1.0
    long = "--gpu-memory-utilization=" + "0" * MAX_ARG_CHARS + "9"
    assert parse_knobs(["vllm", long]) == {}
    assert parse_knobs(["vllm", "--max-model-len", "9" * 100]) == {}


# -- the agent's reads: a fake /proc, a FAKE NVML -----------------------------------------------------


def _proc(root: Path, pid: int, ppid: int, argv: list[str], uid: int = 1000, ticks: int = 777) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    # stat fields after "(comm)": state, ppid, ... field 22 is the start time
    fields = ["S", str(ppid)] + ["0"] * 17 + [str(ticks)]
    (d / "stat").write_text("%d (py thon) %s\n" % (pid, " ".join(fields)))
    (d / "status").write_text("Name:\tpython\nUid:\t%d\t%d\t%d\t%d\n" % (uid, uid, uid, uid))


class FakeNvml:
    """FAKE NVML (no GPU here): devices whose process lists the test sets (real DeviceSample values)."""

    def __init__(self, devices: list[tuple[str, int, list[tuple[int, int]]]]) -> None:
        self.devices = devices

    def device_count(self) -> int:
        return len(self.devices)

    def sample(self, index: int) -> DeviceSample | None:
        uuid, total, procs = self.devices[index]
        return DeviceSample(time_ns=time.time_ns(), index=index, uuid=uuid, name="FAKE GPU",
                            memory_total_bytes=total,
                            processes=tuple(GpuProcess(pid, used, pid, "proc%d" % pid) for pid, used in procs))


def _producer(asm: Assembler, pid: int, pid_id: str | None = None) -> Any:
    return asm.hello({"id": pid_id or "p-%d" % pid, "pid": pid, "start_ns": 1, "trace_id": "1" * 32,
                      "root_span_id": "2" * 16})


def test_knobs_come_from_the_server_when_the_worker_has_none(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    _proc(root, 100, 1, ["python", "-m", "vllm.entrypoints.openai.api_server", "--gpu-memory-utilization=0.93"])
    _proc(root, 200, 100, ["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()"])
    _proc(root, 300, 1, ["vllm", "--gpu-memory-utilization", "0.5"], uid=0)  # another uid's parent
    _proc(root, 400, 300, ["python", "-c", "x"])
    asm = Assembler("host")
    knobs, whose = engine_context.producer_knobs(_producer(asm, 200), str(root))
    assert (knobs, whose) == ({"gpu_memory_utilization": 0.93}, 100)
    assert engine_context.producer_knobs(_producer(asm, 400), str(root)) == ({}, None)  # not read across uids
    assert engine_context.producer_knobs(_producer(asm, 999), str(root)) == ({}, None)  # gone: skipped


def test_a_reused_pid_is_not_read(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    _proc(root, 200, 1, ["vllm", "--gpu-memory-utilization", "0.9"], ticks=555)
    asm = Assembler("host")
    same = _producer(asm, 200, "boot-200-555")
    other = _producer(asm, 200, "boot-200-556")  # the producer started at another tick: pid reused
    assert engine_context.producer_knobs(same, str(root))[0] == {"gpu_memory_utilization": 0.9}
    assert engine_context.producer_knobs(other, str(root)) == ({}, None)
    ctx = engine_context.gather(other, FakeNvml([("GPU-a", 80 * GIB, [(200, GIB)])]), None, str(root))
    # neither its command line nor NVML's view of pid 200: only the host's largest device
    assert ctx == engine_context.LiveContext(host_largest=80 * GIB)


def test_nvml_finds_the_engines_devices_and_tells_its_workers_from_tenants(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    _proc(root, 100, 1, ["vllm", "--tensor-parallel-size", "2"])  # the server, producer
    _proc(root, 101, 100, ["python", "-c", "worker"])  # its workers, one per device
    _proc(root, 102, 100, ["python", "-c", "worker"])
    _proc(root, 500, 1, ["python", "train.py"])  # another user's job on device 1
    nvml = FakeNvml([("GPU-0", 80 * GIB, [(101, 70 * GIB)]), ("GPU-1", 80 * GIB, [(102, 50 * GIB), (500, 20 * GIB)]),
                     ("GPU-2", 80 * GIB, [(500, 10 * GIB)])])
    devs = engine_context.nvml_devices(nvml, 100, str(root))
    assert [(d.device, d.own_bytes, d.other_bytes) for d in devs] == [("GPU-0", 70 * GIB, 0),
                                                                      ("GPU-1", 50 * GIB, 20 * GIB)]
    assert devs[1].others == (Tenant(500, 20 * GIB, "proc500"),)
    # a worker's own OOM: its server is an ancestor, its sibling worker on another device is not seen as its own
    assert [d.device for d in engine_context.nvml_devices(nvml, 101, str(root))] == ["GPU-0"]
    # the producer's program, for the rules that tell an engine by it (ollama's tree holds other models' runners)
    asm = Assembler("host")
    _proc(root, 600, 1, ["/usr/local/bin/ollama", "serve"])
    assert engine_context.gather(_producer(asm, 600), nvml, None, str(root)).program == "ollama"
    assert engine_context.gather(_producer(asm, 100), nvml, None, str(root)).program == "vllm"
    assert engine_context.gather(_producer(asm, 999), nvml, None, str(root)).program is None  # gone
    assert [d.own_names for d in devs] == [("proc101",), ("proc102",)]  # NVML's names of the tree's processes


def test_handlers_refine_an_engine_oom_and_emit_the_context() -> None:
    """In-process: the real handlers with a FAKE NVML; this test process stands for the engine,
    its real /proc entry is read for the knobs (pytest's argv has none)."""
    import os

    me = os.getpid()
    nvml = FakeNvml([("GPU-aaaa", 80 * GIB, [(me, 30 * GIB), (1, 45 * GIB)])])  # pid 1 is never our tree
    h = OomHandlers(OomClassifier([]), nvml)
    asm = Assembler("host", {"oom": h.oom})
    p = _producer(asm, me)
    items = asm.events(p, [[1, 10, "oom", {"source": "log", "text": _record(VLLM_LOADING)}]])
    (log,) = [i for i in items if isinstance(i, LogItem)]
    a = log.attributes
    assert a["infersight.oom.class"] == "reservation_conflict"
    assert a["infersight.oom.context_decided"] is True
    assert a["infersight.oom.context.other_pids"] == [1]
    assert a["infersight.oom.context.total_bytes"] == 80 * GIB
    assert a["infersight.oom.context.own_bytes"] == 30 * GIB
    assert a["infersight.oom.context.nvml"] is True
    assert "reservation_conflict" in log.body and "pid 1" in log.body
    assert h.context_decided == 1
    # the same text again in the window: no second read, no second record
    again = asm.events(p, [[2, 20, "oom", {"source": "log", "text": _record(VLLM_LOADING)}]])
    assert not [i for i in again if isinstance(i, LogItem)]


@pytest.mark.parametrize("nvml", [None, FakeNvml([])])
def test_without_nvml_the_message_verdict_stands(nvml: Any) -> None:
    h = OomHandlers(OomClassifier([]), nvml)
    asm = Assembler("host", {"oom": h.oom})
    p = _producer(asm, 4242424)  # no such process: nothing to read either
    items = asm.events(p, [[1, 10, "oom", {"source": "log", "text": _record(VLLM_LOADING)}]])
    (log,) = [i for i in items if isinstance(i, LogItem)]
    assert log.attributes["infersight.oom.class"] == "unknown"
    assert log.attributes["infersight.oom.context_decided"] is False
    assert h.context_decided == 0


def test_a_host_without_nvml_claims_nothing_of_nvml() -> None:
    """No device NVML can read (the library absent: ``FakeNvml([])``, as ``doctor`` says "nvml absent"): an undecided
    engine error of a live process said "NVML showed none of this engine's processes on a device" and exported
    ``context.nvml`` true (a review: evidence that was never read)."""
    import os

    h = OomHandlers(OomClassifier([]), FakeNvml([]))
    asm = Assembler("host", {"oom": h.oom})
    p = _producer(asm, os.getpid())  # a live process: its command line is read, NVML has nothing to read
    items = asm.events(p, [[1, 10, "oom", {"source": "log", "text": _record(VLLM_LOADING)}]])
    (log,) = [i for i in items if isinstance(i, LogItem)]
    assert log.attributes.get("infersight.oom.context.nvml") is not True
    assert "NVML showed" not in log.body


# Real, JAX 0.11.2 on an H200 (140.4 GiB), preallocation off: one buffer of the device + 1 GiB.
XLA_BEYOND_DEVICE = """E1204 17:14:15.508211     838 gpu_hlo_schedule.cc:1068] The byte size of input/output arguments \
(151828561921) exceeds the base limit (112583507968). This indicates an error in the calculation!
jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 141.40GiB with allocator \
GPU_0_bfc on device 0. [executable_name='jit_broadcast_in_dim'] [tf-allocator-allocation-error='']"""


def test_a_request_beyond_every_device_of_the_host_is_capacity_though_the_engine_has_gone(tmp_path: Path) -> None:
    f = _finding(XLA_BEYOND_DEVICE)
    assert f.rule == "xla.gpu.out-of-memory/over-pool-limit"
    r = refine(f, LiveContext(host_largest=150754820096))  # the H200's, as NVML reads it
    assert r.decided and r.cls == "capacity" and r.rule.endswith("+context.request-exceeds-every-device")
    assert "141.40 GiB" in str(r.reason) and r.attributes["infersight.oom.context.host_largest_bytes"] == 150754820096
    assert not refine(f, LiveContext(host_largest=192 * GIB)).decided  # a larger device on the host may hold it
    # read by the agent: the engine gone, NVML lists the host's devices
    root = tmp_path / "proc"
    root.mkdir()
    h = OomHandlers(OomClassifier([]), FakeNvml([("GPU-a", 80 * GIB, []), ("GPU-b", 140 * GIB, [])]))
    h.proc_root = str(root)
    asm = Assembler("host", {"oom": h.oom})
    items = asm.events(_producer(asm, 4242), [[1, 10, "oom", {"source": "stderr", "text": XLA_BEYOND_DEVICE}]])
    (log,) = [i for i in items if isinstance(i, LogItem)]
    assert log.attributes["infersight.oom.class"] == "capacity"


def _engine_on_a_device(tmp_path: Path, own: int) -> tuple[Path, FakeNvml, OomHandlers, Assembler, Any]:
    """pid 300 (a fake /proc entry) holds ``own`` bytes of a FAKE 140 GiB device; the handlers read both."""
    root = tmp_path / "proc"
    _proc(root, 300, 1, ["python", "serve.py"])
    nvml = FakeNvml([("GPU-h200", 140 * GIB, [(300, own)])])
    h = OomHandlers(OomClassifier([]), nvml)
    h.proc_root = str(root)
    asm = Assembler("host", {"oom": h.oom})
    return root, nvml, h, asm, _producer(asm, 300)


def test_a_context_read_as_the_error_was_printed_stands_in_once_the_engine_has_gone(tmp_path: Path) -> None:
    """launch reads the context when a capture of CMD's stderr opens: on an H200, JAX printed its error and
    exited (bench/gpu_check_engines.py) before the capture was classified, and NVML no longer listed it."""
    root, nvml, h, asm, p = _engine_on_a_device(tmp_path, 15 * GIB)
    # launch reads it for CMD's pid (its own producer: the hooked process's may not have said hello yet)
    early = Producer("launch-early-300", {"pid": 300, "launched": True}, Resource.of({}))
    done = h.read_early(early)
    assert done is not None and done.wait(10)
    again = h.read_early(early)
    # one read at a time per pid, not one per pid ever; this one ends before the engine exits (CI had it end after:
    # the latest read, empty, is kept, test_an_older_early_read_is_no_evidence_once_a_later_one_found_nothing)
    assert again is not None and again.wait(10)
    shutil.rmtree(root / "300")  # it printed its error and exited
    nvml.devices = [("GPU-h200", 140 * GIB, [])]
    items = asm.events(p, [[1, 10, "oom", {"source": "stderr", "text": XLA_OVER_POOL}]])
    (log,) = [i for i in items if isinstance(i, LogItem)]
    a = log.attributes
    assert a["infersight.oom.class"] == "reservation_conflict"
    assert str(a["infersight.oom.rule"]).endswith("+context.pool-below-device")
    assert a["infersight.oom.context.early"] is True and h.early_used == 1
    assert "as the error was printed" in log.body
    # the same, its context never read early: the message's own verdict
    h2 = OomHandlers(OomClassifier([]), nvml)
    h2.proc_root = str(root)
    asm2 = Assembler("host", {"oom": h2.oom})
    items = asm2.events(_producer(asm2, 300), [[1, 10, "oom", {"source": "stderr", "text": XLA_OVER_POOL}]])
    (log,) = [i for i in items if isinstance(i, LogItem)]
    assert log.attributes["infersight.oom.class"] == "unknown" and h2.early_used == 0


def test_the_hook_sends_flags_and_numbers_only() -> None:
    from infersight.hooks._enginelog import MAX_ARGS, knob_args

    argv = ["-m", "vllm.entrypoints.openai.api_server", "--model", "/models/private", "--api-key", "sk-secret",
            "--gpu-memory-utilization", "0.95", "--max_model_len=8192", "--hf-token=hf_abc", "--enforce-eager",
            "x" * 100]
    sent = knob_args(argv)
    assert sent == ["-m", "", "--model", "", "--api-key", "", "--gpu-memory-utilization", "0.95",
                    "--max_model_len=8192", "--hf-token=", "--enforce-eager", ""]
    assert parse_knobs(sent) == {"gpu_memory_utilization": 0.95, "max_model_len": 8192, "enforce_eager": True}
    assert len(knob_args(["--x"] * 10_000)) == MAX_ARGS == engine_context.MAX_SENT_ARGS


def test_a_gone_process_is_read_from_what_its_hooks_sent(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    root.mkdir()
    asm = Assembler("host")
    p = asm.hello({"id": "p-77", "pid": 77, "start_ns": 1, "trace_id": "1" * 32, "root_span_id": "2" * 16},
                  uid=1000)  # over a socket: a uid, so the hello's own keys are not taken as launch's argv
    sent = engine_context.sent_args(["--gpu-memory-utilization", "0.8"])
    assert engine_context.producer_knobs(p, str(root), sent) == ({"gpu_memory_utilization": 0.8}, 77)
    _proc(root, 77, 1, ["vllm", "--gpu-memory-utilization", "0.5"])
    # no ticks in its id: pid 77 here may be another process; what its hooks sent is its own
    assert engine_context.producer_knobs(p, str(root), sent) == ({"gpu_memory_utilization": 0.8}, 77)
    shutil.rmtree(root / "77")
    q = asm.hello({"id": "boot-77-5", "pid": 77, "start_ns": 1, "trace_id": "1" * 32, "root_span_id": "2" * 16},
                  uid=1000)
    _proc(root, 77, 1, ["python", "-c", "x"], ticks=5)  # alive, without knobs of its own: /proc wins
    assert engine_context.producer_knobs(q, str(root), sent) == ({}, None)
    (root / "77" / "cmdline").write_bytes(b"")  # a zombie's cmdline is empty
    assert engine_context.producer_knobs(q, str(root), sent) == ({"gpu_memory_utilization": 0.8}, 77)
    shutil.rmtree(root / "77")  # gone
    assert engine_context.producer_knobs(q, str(root), sent) == ({"gpu_memory_utilization": 0.8}, 77)
    ctx = engine_context.gather(q, FakeNvml([("GPU-a", 80 * GIB, [(77, GIB)])]), None, str(root), sent)
    assert ctx.pid is None and not ctx.nvml and ctx.knobs == {"gpu_memory_utilization": 0.8}
    assert engine_context.sent_args(["a"] * 1000) is None and engine_context.sent_args([1, 2]) is None


def test_a_huge_proc_cmdline_is_read_bounded(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    _proc(root, 100, 1, ["vllm"])
    huge = b"\0".join([b"--x" * 1000] * 2000) + b"\0--gpu-memory-utilization\x000.9\0"  # 6 MB, knob at the end
    (root / "100" / "cmdline").write_bytes(huge)
    argv = engine_context.read_cmdline(100, str(root))
    assert argv is not None and sum(len(a) + 1 for a in argv) <= engine_context.MAX_CMDLINE + 1
    assert parse_knobs(argv) == {}  # beyond the bound: not read, not a crash
    (root / "100" / "cmdline").write_bytes(b"vllm\0--gpu-memory-utilization\0\xff\xfe0.9\0--max-num-seqs\x0064\0")
    assert engine_context.read_cmdline(100, str(root)) == ["vllm", "--gpu-memory-utilization", "\ufffd\ufffd0.9",
                                                           "--max-num-seqs", "64"]
    assert parse_knobs(engine_context.read_cmdline(100, str(root)) or []) == {"max_num_seqs": 64}


async def test_the_engine_context_is_read_off_the_event_loop_under_the_device_lock() -> None:
    import os

    from nvml_calls import NvmlCalls

    calls = NvmlCalls()
    me = os.getpid()
    published: list[Any] = []
    nvml = calls.watch(FakeNvml([("GPU-aaaa", 80 * GIB, [(me, 30 * GIB), (1, 45 * GIB)])]))
    h = OomHandlers(OomClassifier([]), nvml, publish=published.extend, nvml_guard=calls.guard)
    asm = Assembler("host", {"oom": h.oom})
    p = _producer(asm, me)
    items = asm.events(p, [[1, 10, "oom", {"source": "log", "text": _record(VLLM_LOADING)}]])
    assert not [i for i in items if isinstance(i, LogItem)], "finished later, off the loop"
    await h.wait_later(10)
    (log,) = [i for i in published if isinstance(i, LogItem)]
    assert log.attributes["infersight.oom.class"] == "reservation_conflict"
    assert calls.off_this_thread_under_the_lock(), calls.seen


_KV_GAP = ("ValueError: The model's max seq len (8192) is larger than the maximum number of tokens that can be stored "
           "in KV cache (7900). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when "
           "initializing the engine.")


@pytest.mark.parametrize(("frac", "cls", "suffix"), [
    (0.98, "capacity", "+context.fraction-at-top"),
    (0.95, "capacity", "+context.fraction-at-top"),
    (0.6, "reservation_conflict", "+context.fraction-has-room"),
    (0.82, "reservation_conflict", "+context.fraction-has-room"),
    (0.9, "unknown", ""),  # the default: raising to 0.95 may or may not cover 15% of the pool
])
def test_vllm_s_small_kv_gap_is_decided_by_the_utilization_on_its_command_line(frac: float, cls: str,
                                                                               suffix: str) -> None:
    f = _finding(_KV_GAP)
    assert (f.cls, f.rule) == ("unknown", "vllm.kv.max-model-len/within-fraction-headroom")
    r = refine(f, LiveContext(pid=1, knobs={"gpu_memory_utilization": frac}))  # no NVML needed
    assert (r.cls, r.rule, r.decided) == (cls, f.rule + suffix, bool(suffix))
    if cls == "capacity":
        assert "--max-model-len" in r.remedy and "%g" % frac in str(r.reason)
    elif cls == "reservation_conflict":
        assert r.remedy.startswith("Raise --gpu-memory-utilization from %g" % frac)
        assert r.attributes["infersight.oom.context.fraction_knob"] == "gpu_memory_utilization"
    # no utilization on the command line: the message's unknown stands
    assert not refine(f, LiveContext(pid=1)).decided


def test_one_uid_flooding_logs_with_distinct_errors_is_capped_and_cannot_evict_another_uids_messages() -> None:
    """A stderr capture or a log may hold many distinct memory errors: one uid reports at most
    MAX_NEW_PER_UID of them per dedup window (the rest counted as over budget), and its flood forgets only
    its own remembered messages, so another uid's repeat inside the window stays a duplicate."""
    from infersight.agent.oom import kind

    h = OomHandlers(OomClassifier([]), None)
    asm = Assembler("host", {"oom": h.oom})
    quiet = asm.hello({"id": "quiet", "pid": 11, "start_ns": 1, "trace_id": "1" * 32, "root_span_id": "2" * 16},
                      uid=1001)
    noisy = asm.hello({"id": "noisy", "pid": 12, "start_ns": 1, "trace_id": "3" * 32, "root_span_id": "4" * 16},
                      uid=1002)
    mine = ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 512.00 MiB on device 0: cudaMalloc failed: "
            "out of memory")
    first = [i for i in asm.events(quiet, [[1, 10, "oom", {"source": "stderr", "text": mine}]])
             if isinstance(i, LogItem)]
    assert len(first) == 1
    flood = "\n".join("ggml_backend_cuda_buffer_type_alloc_buffer: allocating %d.00 MiB on device 0: cudaMalloc "
                      "failed: out of memory" % (1000 + i) for i in range(300))
    items = []
    for k in range(3):
        items += asm.events(noisy, [[2 + k, 20 + k, "oom", {"source": "stderr", "text": flood}]])
    logs = [i for i in items if isinstance(i, LogItem)]
    assert len(logs) == kind.MAX_NEW_PER_PRODUCER and h.over_budget > 0
    again = [i for i in asm.events(quiet, [[2, 30, "oom", {"source": "stderr", "text": mine}]])
             if isinstance(i, LogItem)]
    assert again == [] and h.duplicates >= 1


_FAR = ("ValueError: The model's max seq len (32768) is larger than the maximum number of tokens that can be stored in "
        "KV cache (20512). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the "
        "engine.")
_FAR_BYTES = ("ValueError: To serve at least one request with the models's max seq len (131072), (16.00 GiB KV cache "
              "is needed, which is larger than the available KV cache memory (12.00 GiB). Try increasing "
              "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.")


@pytest.mark.parametrize(("text", "frac", "total_gib", "cls", "decided"), [
    (_FAR, 0.5, None, "reservation_conflict", True),   # 1.6x a pool of at most 0.5 of the device: 0.4 more covers it
    (_FAR, 0.85, None, "unknown", True),               # 0.05 more may or may not: the pool's bytes are not printed
    (_FAR, 0.92, None, "capacity", False),             # at or above the default: the message's verdict stands
    (_FAR_BYTES, 0.86, 80, "capacity", False),         # 4 GiB lacking; 0.04 of 80 GiB adds 3.2 GiB: kept
    (_FAR_BYTES, 0.8, 80, "reservation_conflict", True),  # 0.1 of 80 GiB adds 8 GiB, more than the 4 GiB lacking
])
def test_a_far_max_model_len_gap_is_re_read_with_the_command_lines_fraction(
        text: str, frac: float, total_gib: int | None, cls: str, decided: bool) -> None:
    """vLLM's max-model-len error with a gap of 1.2x or more is capacity from the default 0.9; a command line that
    sets gpu_memory_utilization lower breaks that premise: the pool is at most that share of the device, so
    raising the fraction to 0.9 covers the gap when (ratio - 1) x f <= 0.9 - f, or when the bytes lacking fit
    in what it adds of the device's size (NVML)."""
    (f,) = analyse(text)
    assert f.rule == "vllm.kv.max-model-len/far-beyond-pool" and f.cls == "capacity"
    devices = (DeviceContext("GPU-a", total_gib * GIB, 60 * GIB),) if total_gib else ()
    r = refine(f, LiveContext(pid=1, devices=devices, nvml=bool(devices), knobs={"gpu_memory_utilization": frac}))
    assert (r.cls, r.decided) == (cls, decided), (r.rule, r.reason, r.note)
    if cls == "reservation_conflict":
        assert "--gpu-memory-utilization" in r.remedy and r.attributes["infersight.oom.context.fraction_knob"]
    if cls == "unknown":
        assert r.reason and "profiling line" in r.reason


def test_the_far_gap_re_reading_counts_other_processes_and_pools_set_outright() -> None:
    """Two replicas at 0.45 on one 80 GiB device: raising either's fraction could take only what is free beside
    the other, 8 GiB, short of the pool's 0.6x: the message's capacity stands, with the tenant noted. A pool sized
    outright (--num-gpu-blocks-override, --kv-cache-memory-bytes) does not follow the fraction: no re-reading."""
    (f,) = analyse(_FAR)
    other = Tenant(4242, 36 * GIB, "python")
    shared = DeviceContext("GPU-a", 80 * GIB, 36 * GIB, (other,))
    r = refine(f, LiveContext(pid=1, devices=(shared,), nvml=True, knobs={"gpu_memory_utilization": 0.45}))
    assert (r.cls, r.decided) == ("capacity", False)
    assert "pid 4242" in r.attributes.get("infersight.oom.context.conflict", ""), r.attributes
    for flag in (["--num-gpu-blocks-override", "2000"], ["--kv-cache-memory-bytes", "8G"]):
        knobs = parse_knobs(["vllm", "serve", "m", "--gpu-memory-utilization", "0.5", *flag])
        r = refine(f, LiveContext(pid=1, knobs=knobs))
        assert (r.cls, r.decided) == ("capacity", False), flag


def test_the_budget_is_per_producer_and_what_it_refuses_is_not_remembered() -> None:
    """Eight engines of one user failing at once, each with its own numbers, each report their errors; a message
    a flooding producer's budget refused is not remembered, so the same error raised as an exception goes out."""
    from infersight.agent.oom import kind

    h = OomHandlers(OomClassifier([]), None)
    asm = Assembler("host", {"oom": h.oom})

    def engine(n: int) -> Any:
        return asm.hello({"id": "llama-%d" % n, "pid": 100 + n, "start_ns": 1, "trace_id": "%032x" % (n + 1),
                          "root_span_id": "%016x" % (n + 1)}, uid=1000)

    def err(mib: int, dev: int) -> str:
        return ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating %d.00 MiB on device %d: cudaMalloc failed: "
                "out of memory" % (mib, dev))

    logs = []
    for n in range(8):
        p = engine(n)
        for k in range(3):  # the load, then two smaller retries
            logs += [i for i in asm.events(p, [[1 + k, 10 + k, "oom", {"source": "stderr", "text": err(9000 - k * 1000,
                                                                                                       n)}]])
                     if isinstance(i, LogItem)]
    assert len(logs) == 24 and h.over_budget == 0
    flood = engine(99)
    filler = "\n".join("request %d served" % i for i in range(12))  # past a rule's window: separate events
    text = "\n".join(err(20000 + i, 0) + "\n" + filler for i in range(kind.MAX_NEW_PER_PRODUCER + 1))
    asm.events(flood, [[1, 50, "oom", {"source": "stderr", "text": text}]])
    assert h.over_budget == 1
    refused = err(20000 + kind.MAX_NEW_PER_PRODUCER, 0)
    raised = [i for i in asm.events(flood, [[2, 60, "oom", {"source": "exception", "text": refused}]])
              if isinstance(i, LogItem)]
    assert len(raised) == 1


def test_a_producer_cannot_reopen_its_budget_with_event_timestamps_an_hour_apart() -> None:
    """The per-producer budget runs on the agent's clock: a member of the socket group writes its events'
    timestamps, and one hour between each reopened the window for every text (all went out)."""
    from infersight.agent.oom import kind

    h = OomHandlers(OomClassifier([]), None)
    asm = Assembler("host", {"oom": h.oom})
    p = asm.hello({"id": "forger", "pid": 13, "start_ns": 1, "trace_id": "5" * 32, "root_span_id": "6" * 16},
                  uid=1003)
    hour = 3600 * 10**9
    logs = []
    for i in range(kind.MAX_NEW_PER_PRODUCER + 4):
        text = ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating %d.00 MiB on device 0: cudaMalloc failed: "
                "out of memory" % (30000 + i))
        logs += [x for x in asm.events(p, [[1 + i, (1 + i) * hour, "oom", {"source": "stderr", "text": text}]])
                 if isinstance(x, LogItem)]
    assert len(logs) == kind.MAX_NEW_PER_PRODUCER and h.over_budget == 4


def test_one_uids_distinct_texts_cost_the_loop_a_bounded_time_and_another_uids_oom_still_goes_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Texts are analysed before any producer budget can tell them apart, and analysis runs on the event
    loop: a member of the socket group sending distinct texts (as exceptions, which no producer budget
    covers, from many producers) held the loop 14 s for 30,000. Now one uid's texts take at most
    ANALYSIS_NS_PER_UID of the loop per window (on the agent's clock, not the events'); past it they are not
    read, counted, and another uid's OOM is classified as before."""
    from infersight.agent.oom import kind

    monkeypatch.setattr(kind, "ANALYSIS_NS_PER_UID", 20_000_000)  # 20 ms: a few dozen texts here
    h = OomHandlers(OomClassifier([]), None)
    asm = Assembler("host", {"oom": h.oom})
    floods = [asm.hello({"id": "f%d" % i, "pid": 100 + i, "start_ns": 1, "trace_id": "%032x" % (i + 1),
                         "root_span_id": "%016x" % (i + 1)}, uid=1002) for i in range(50)]
    victim = asm.hello({"id": "victim", "pid": 11, "start_ns": 1, "trace_id": "1" * 32, "root_span_id": "2" * 16},
                       uid=1001)
    text = ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating %d.00 MiB on device 0: cudaMalloc failed: "
            "out of memory " + "padding " * 1500)
    for i, p in enumerate(floods):  # 2,000 distinct texts, spread over an hour of the events' own clock
        n = i * 40
        asm.events(p, [[k + 1, (n + k) * 31_000_000_000, "oom", {"source": "exception", "text": text % (n + k)}]
                       for k in range(40)])
    assert h.over_uid_budget > 1900, h.over_uid_budget  # not read: a few dozen were, at ~1 ms each
    assert h.ooms < 100
    mine = [i for i in asm.events(victim, [[1, 10, "oom", {"source": "exception", "text": text % 7}]])
            if isinstance(i, LogItem)]
    assert len(mine) == 1


XLA_EXCEPTION = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 28.08GiB with allocator GPU_0_bfc on "
                 "device 0. [executable_name='jit_broadcast_in_dim'] [tf-allocator-allocation-error='']")


async def test_an_undecided_engine_error_held_for_launchs_stderr_copy_goes_out_when_none_comes() -> None:
    """Under launch (``relayed``) an undecided error the hooks reported waits HOLD_FOR_STDERR_S for the stderr copy;
    none comes (the engine's stderr went to a file): it goes out, once. A decided one never waits."""
    import asyncio

    from infersight.agent.oom import kind

    published: list[Any] = []
    h = OomHandlers(OomClassifier([]), None, publish=published.extend)
    h.relayed = lambda p: True
    asm = Assembler("host", {"oom": h.oom})
    p = _producer(asm, 4242424)
    items = asm.events(p, [[1, 10, "oom", {"source": "exception", "text": XLA_EXCEPTION}]])
    assert not [i for i in items if isinstance(i, LogItem)]
    await asyncio.sleep(kind.HOLD_FOR_STDERR_S / 2)
    assert not published  # held
    deadline = time.monotonic() + 30  # the hold's end, then the context read on a thread: late on a loaded machine
    while not published and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    (log,) = [i for i in published if isinstance(i, LogItem)]
    assert log.attributes["infersight.oom.source"] == "exception"
    assert log.attributes["infersight.oom.class"] == "unknown" and h.stderr_preferred == 0
    # a class the message decides goes out at once (through the context read, off the loop)
    published.clear()
    asm.events(p, [[2, 20, "oom", {"source": "exception", "text": "Not enough memory. Please try to increase "
                                   "--mem-fraction-static."}]])
    assert not h._held
    await h.wait_later(30)
    (log,) = [i for i in published if isinstance(i, LogItem)]
    assert log.attributes["infersight.oom.class"] != "unknown"
    # at shutdown a held copy goes out at once
    published.clear()
    asm.events(p, [[3, 30, "oom", {"source": "log", "text": XLA_EXCEPTION.replace("28.08GiB", "9.00GiB")}]])
    assert h._held
    await h.wait_later(30)
    assert [i for i in published if isinstance(i, LogItem)] and not h._held


async def test_a_held_error_waits_for_a_relay_that_launch_has_not_started_yet(monkeypatch: Any) -> None:
    """A joined launch forwards its relay's captures only once its event loop runs, after CMD's spawn (1.7 s on a
    busy 2-core host): the hooks' copy of an error CMD logged at once went out after HOLD_FOR_STDERR_S, and launch's
    copy, with what the engine printed around it, came too late to replace it. While the relay has not started
    the copy waits (at most RELAY_START_WAIT_S), then HOLD_FOR_STDERR_S from the relay's start."""
    import asyncio

    from infersight.agent.oom import kind

    published: list[Any] = []
    h = OomHandlers(OomClassifier([]), None, publish=published.extend)
    h.relayed = lambda p: True
    started: list[float | None] = [None]
    h.relay_started = lambda p: started[0]
    asm = Assembler("host", {"oom": h.oom})
    p = _producer(asm, 4242425)
    asm.events(p, [[1, 10, "oom", {"source": "log", "text": XLA_EXCEPTION}]])
    await asyncio.sleep(kind.HOLD_FOR_STDERR_S * 3)
    assert h._held and not published  # still waiting: launch's relay has not started
    started[0] = time.monotonic()  # its "relaying" frame; the capture it kept comes right after
    await asyncio.sleep(kind.HOLD_FOR_STDERR_S / 4)
    assert h._held
    asm.events(p, [[2, 20, "oom", {"source": "stderr", "text": "2026-12-05 E jax: pool limit 30.00GiB\n"
                                   + XLA_EXCEPTION}]])
    await h.wait_later(30)
    (log,) = [i for i in published if isinstance(i, LogItem)]
    assert log.attributes["infersight.oom.source"] == "stderr" and h.stderr_preferred == 1
    # a relay that never starts (launch died before its loop ran): the copy goes out at RELAY_START_WAIT_S
    monkeypatch.setattr(kind, "RELAY_START_WAIT_S", kind.HOLD_FOR_STDERR_S * 2)
    published.clear()
    started[0] = None
    held_at = time.monotonic()
    asm.events(p, [[3, 30, "oom", {"source": "log", "text": XLA_EXCEPTION.replace("28.08GiB", "7.00GiB")}]])
    assert h._held
    deadline = time.monotonic() + 30
    while h._held and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert not h._held and time.monotonic() - held_at >= kind.RELAY_START_WAIT_S
    await h.wait_later(30)
    (log,) = [i for i in published if isinstance(i, LogItem)]
    assert log.attributes["infersight.oom.source"] == "log"


async def test_two_processes_held_undecided_errors_are_two_records_each_with_its_context(tmp_path: Path) -> None:
    """Two workers of CMD (not one process family) hold the same undecided text at once: two records, neither
    replacing the other; and each held one's context is read when it is held (the worker may exit during the
    hold: here its pid leaves NVML's list and /proc before the hold ends)."""
    import asyncio

    from infersight.agent.oom import kind

    root = tmp_path / "proc"
    _proc(root, 301, 1, ["python", "worker.py"])
    _proc(root, 302, 1, ["python", "worker.py"])
    nvml = FakeNvml([("GPU-h200", 140 * GIB, [(301, 2 * GIB), (302, 2 * GIB), (999, 100 * GIB)])])
    published: list[Any] = []
    h = OomHandlers(OomClassifier([]), nvml, publish=published.extend)
    h.proc_root = str(root)
    h.relayed = lambda p: True
    asm = Assembler("host", {"oom": h.oom})
    one, two = (asm.hello({"id": "boot-%d-777" % pid, "pid": pid, "start_ns": 1, "trace_id": "%032x" % pid,
                           "root_span_id": "%016x" % pid}, uid=1000) for pid in (301, 302))
    for p in (one, two):
        asm.events(p, [[1, 10, "oom", {"source": "exception", "text": XLA_EXCEPTION}]])
    assert len(h._held) == 2
    deadline = time.monotonic() + 30  # the early reads (one per held producer, on threads) end
    while (h._early_running or len(h._early) < 2) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert not h._early_running and len(h._early) == 2  # read before the workers exit below
    shutil.rmtree(root / "301")
    shutil.rmtree(root / "302")
    nvml.devices = [("GPU-h200", 140 * GIB, [(999, 100 * GIB)])]  # both exited
    await asyncio.sleep(kind.HOLD_FOR_STDERR_S)
    await h.wait_later(30)
    logs = [i for i in published if isinstance(i, LogItem)]
    assert len(logs) == 2
    assert {x.attributes["infersight.oom.class"] for x in logs} == {"reservation_conflict"}  # pid 999's 100 GiB
    assert all(x.attributes["infersight.oom.context.early"] is True for x in logs)


def test_an_older_early_read_is_no_evidence_once_a_later_one_found_nothing(tmp_path: Path) -> None:
    """Captures open on common words: an early read from before the engine's pool was allocated must not stand in
    for the context of a later error (the latest read, empty, is kept)."""
    root, nvml, h, asm, p = _engine_on_a_device(tmp_path, 2 * GIB)
    done = h.read_early(p)
    assert done is not None and done.wait(10)
    shutil.rmtree(root / "300")
    nvml.devices = [("GPU-h200", 140 * GIB, [])]
    done = h.read_early(p)  # a later capture opened as the engine was gone
    assert done is not None and done.wait(10)
    items = asm.events(p, [[1, 10, "oom", {"source": "stderr", "text": XLA_OVER_POOL}]])
    (log,) = [i for i in items if isinstance(i, LogItem)]
    assert "infersight.oom.context.early" not in log.attributes and h.early_used == 0
