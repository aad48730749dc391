"""Serving-engine memory errors (issue 24): recognised, classified in the engine's terms,
``unknown`` with a reason when the text does not decide, no false alarms.

The data is vendored: ``tests/support/data/serving_ooms_given.jsonl`` (30 labelled messages with
their threads), ``serving_ooms_collected.jsonl`` (more from other public threads, real
non-memory errors of the same engines among them, each with its source) and
``serving_ooms_unseen.jsonl`` (a second collection, labelled before the rules it measures
were changed; records whose thread a rule example quotes are marked ``in_rule_examples``) and
``serving_ooms_collected2.jsonl`` (a third, split by URL hash into a ``tune`` and a ``held_out``
half before any rule ran on it), ``serving_ooms_collected3.jsonl`` (a fourth, all held out) and
``serving_ooms_collected4.jsonl`` (a fifth, split by the SHA-256 of the URL before any rule ran on it) and
``serving_ooms_collected5.jsonl`` (a sixth, split the same way and committed before any rule ran on it).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from infersight.agent.commands.classify import main
from infersight.bytesize import parse_bytes
from infersight.rules import serving
from infersight.rules.serving import (
    ENGINES,
    ServingRulesError,
    analyse,
    builtin,
    builtin_serving_path,
    detect_engine,
    load_serving_rules,
)
from infersight.rules.serving_measure import score

DATA = Path(__file__).resolve().parents[1] / "support" / "data"


def _load(name: str) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(x) for x in (DATA / name).read_text(encoding="utf-8").splitlines() if x.strip()]


GIVEN = _load("serving_ooms_given.jsonl")
COLLECTED = _load("serving_ooms_collected.jsonl")
UNSEEN = _load("serving_ooms_unseen.jsonl")
THIRD = _load("serving_ooms_collected2.jsonl")
FOURTH = _load("serving_ooms_collected3.jsonl")
FIFTH = _load("serving_ooms_collected4.jsonl")
SIXTH = _load("serving_ooms_collected5.jsonl")
SEVENTH = _load("serving_ooms_collected6.jsonl")
EIGHTH = _load("serving_ooms_collected7.jsonl")
NINTH = _load("serving_ooms_collected8.jsonl")
TENTH = _load("serving_ooms_collected9.jsonl")
ELEVENTH = _load("serving_ooms_collected10.jsonl")
TWELFTH = _load("serving_ooms_collected11.jsonl")
THIRTEENTH = _load("serving_ooms_collected12.jsonl")
FOURTEENTH = _load("serving_ooms_collected13.jsonl")
FIFTEENTH = _load("serving_ooms_collected14.jsonl")
SIXTEENTH = _load("serving_ooms_collected15.jsonl")
SEVENTEENTH = _load("serving_ooms_collected16.jsonl")
EIGHTEENTH = _load("serving_ooms_collected17.jsonl")


def test_the_data_is_vendored_with_sources() -> None:
    assert len(GIVEN) == 30
    for r in GIVEN + COLLECTED + UNSEEN + THIRD + FOURTH + FIFTH + SIXTH + SEVENTH + EIGHTH + NINTH + TENTH + ELEVENTH:
        assert r["url"].startswith("https://github.com/"), r["id"]
    for r in GIVEN + UNSEEN + THIRD + FOURTH + FIFTH + SIXTH + SEVENTH + EIGHTH + NINTH + TENTH + ELEVENTH:
        assert r["context"] and r["label_reason"], r["id"]
        assert r["label"] in ("capacity", "reservation_conflict", "fragmentation", "unclear", "not_oom")
    assert sum(r["label"] == "not_oom" for r in COLLECTED) >= 10


def test_every_builtin_rule_carries_examples_that_pass() -> None:
    rs = builtin()
    assert rs.rules
    for rule in rs.rules:
        kinds = {e.kind for e in rule.examples}
        assert kinds == {"positive", "negative"}, rule.id
        assert len(rule.mechanism.split()) >= 8, rule.id
    assert rs.check_examples() == []


# The targets of issue 24, on every labelled message we hold (the held-out set is measured
# elsewhere; bench/serving_oom_measure.py prints these figures per set).
def test_targets_on_the_given_messages() -> None:
    s = score(GIVEN)
    assert s.recognised == s.memory_errors == 30
    assert s.unclear_unknown >= s.unclear / 2
    # 19 of 22: srv-009 (vLLM's bare "No available memory for the cache blocks", fragmentation by its
    # thread), srv-017 (a cut PyTorch message) and srv-058 (ollama's bare CUDA error) print no evidence
    assert s.clear_right / s.clear >= 0.8, s.misses
    for cls, (right, n) in s.per_class.items():
        assert right / n >= 0.5, (cls, s.misses)


def test_targets_on_the_collected_messages() -> None:
    s = score(COLLECTED)
    assert s.recognised / s.memory_errors >= 0.9, s.misses
    assert s.false_alarms == 0, s.misses
    assert s.unclear_unknown >= s.unclear / 2, s.misses


@pytest.mark.parametrize("text", [
    "RuntimeError: CUDA error: an illegal memory access was encountered",
    "torch.AcceleratorError: CUDA error: misaligned address",
    "RuntimeError: CUDA error: device-side assert triggered",
    "[rank0]:[E ProcessGroupNCCL.cpp:563] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, "
    "OpType=ALLREDUCE) ran for 600086 milliseconds before timing out.",
    "ValueError: token_to_kv_pool_allocator memory leak detected! available_size=644, evictable_size=269628",
    "AssertionError: max_num_batched_tokens (2048) is smaller than max_model_len (8192).",
    "ValueError: The decoder prompt (length 9000) is longer than the maximum model length of 8192.",
    "Memory access fault by GPU node-2 (Agent handle: 0x55d4) on address 0x7f. Reason: Page not present.",
    "INFO 11-18 18:07:20 worker.py:232] Memory profiling takes 4.2 seconds; the current memory utilization is 0.9",
    # SGLang retracting requests from a full KV pool and going on: admission control, not a failure
    "[2025-03-07 21:49:33 TP13] Decode out of memory happened. #retracted_reqs: 1, #new_token_ratio: 0.1474 -> 0.1845",
    "ggml_cuda_host_malloc: failed to allocate 1900,00 MiB of pinned memory: invalid argument",
    "Exception(3) tid(2a4c) 887A0005 The GPU device instance has been suspended.",
    # advice for an OOM that may come (Real-ESRGAN prints it after any RuntimeError of its upsampler)
    "Error CUDA error: an illegal memory access was encountered\n"
    "If you encounter CUDA out of memory, try to set --tile with a smaller number.",
    "INFO: If you encounter out of memory errors, try lowering --max-num-seqs",
])
def test_no_false_alarm_on_non_memory_engine_errors(text: str) -> None:
    assert analyse(text) == []


def test_bare_cuda_out_of_memory_is_unknown_with_a_reason(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "log"
    p.write_text("CUDA out of memory.\n", encoding="utf-8")
    assert main(["--json", str(p)]) == 0
    (obj,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert obj["class"] == "unknown"
    assert "no requested, free or total size" in obj["reason"]
    assert obj["engine"] in ENGINES


def test_json_contract_for_an_engine_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = next(r["message"] for r in GIVEN if r["id"] == "srv-025")
    p = tmp_path / "log"
    p.write_text(text, encoding="utf-8")
    assert main(["--json", str(p)]) == 0
    (obj,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert obj["engine"] == "vllm"
    assert obj["class"] == "reservation_conflict"
    assert obj["knob"] == "gpu_memory_utilization"
    assert "--gpu-memory-utilization" in obj["remedy"]
    nums = obj["numbers"]
    assert list(nums)[:8] == list("RTFAPUOL")
    assert nums["F"] == round(0.49 * (1 << 30)) and nums["T"] == round(79.32 * (1 << 30))
    assert nums["L"] == round(47.59 * (1 << 30))
    assert nums["fraction"] == 0.6
    assert "reason" not in obj


def test_unknown_always_has_a_reason_and_remedies_use_engine_knobs() -> None:
    knobs = {
        "vllm": "--gpu-memory-utilization", "sglang": "--mem-fraction-static", "tgi": "--max-batch-prefill-tokens",
        "onnxruntime": "arena_extend_strategy", "llama.cpp": "-c", "xla": "XLA_PYTHON_CLIENT_MEM_FRACTION",
    }
    seen: set[str] = set()
    for r in GIVEN + COLLECTED:
        for f in analyse(r["message"]):
            assert f.engine in ENGINES
            if f.cls == "unknown":
                assert f.reason and len(f.reason.split()) >= 8, f.rule
            if f.engine in knobs and f.message is None:
                seen.add(f.engine)
    assert seen >= {"vllm", "sglang", "tgi", "onnxruntime", "llama.cpp", "xla"}
    rem = {f.engine: f.remedy for r in GIVEN for f in analyse(r["message"]) if f.message is None}
    for engine, knob in knobs.items():
        assert knob in rem[engine] or any(knob in f.remedy for r in GIVEN + COLLECTED
                                          for f in analyse(r["message"]) if f.engine == engine), engine


def test_numbers_and_engine_keys() -> None:
    (f,) = analyse(next(r["message"] for r in GIVEN if r["id"] == "srv-013"))
    assert (f.engine, f.cls, f.knob) == ("vllm", "capacity", "gpu_memory_utilization")
    assert f.extra["max_model_len"] == 29000 and f.extra["kv_tokens"] == 23648
    assert f.extra["fraction"] == 0.9
    (f,) = analyse(next(r["message"] for r in GIVEN if r["id"] == "srv-053"))
    assert (f.engine, f.cls, f.numbers["R"]) == ("llama.cpp", "capacity", 204800 << 20)
    (f,) = analyse(next(r["message"] for r in GIVEN if r["id"] == "srv-070"))
    assert f.numbers["T"] == round(15.48 * (1 << 30)) and f.extra["arguments_bytes"] == round(15.90 * (1 << 30))


def test_the_unseen_set_is_quoted_by_no_rule_example() -> None:
    """The second collection measures the rules only if no rule example quotes its threads."""
    rule_text = builtin_serving_path().read_text(encoding="utf-8")
    for r in UNSEEN:
        cited = re.search(re.escape(r["url"]) + r"(?!\d)", rule_text) is not None
        assert cited == r["in_rule_examples"], r["id"]
    assert sum(not r["in_rule_examples"] for r in UNSEEN) >= 30
    assert sum(r["label"] == "not_oom" for r in UNSEEN) >= 5


def test_the_third_collection_is_split_and_its_held_out_half_quoted_by_no_rule_example() -> None:
    rule_text = builtin_serving_path().read_text(encoding="utf-8")
    urls = [r["url"] for r in GIVEN + COLLECTED + UNSEEN]
    later = THIRD + FOURTH + FIFTH + SIXTH + SEVENTH
    assert len({r["url"] for r in later}) == len(later)
    for r in later:
        assert r["split"] in ("tune", "held_out"), r["id"]
        assert r["url"] not in urls, r["id"]  # threads of the earlier sets are not counted twice
        cited = re.search(re.escape(r["url"]) + r"(?!\d)", rule_text) is not None
        assert cited == r["in_rule_examples"], r["id"]
        assert not (r["split"] == "held_out" and cited), r["id"]
    assert len(THIRD) >= 40 and sum(r["label"] == "not_oom" for r in THIRD) >= 8


# The blind collections in the order they were collected, each with its least number of non-memory errors.
_BLIND_SETS = [("fifth", FIFTH, 8), ("sixth", SIXTH, 5), ("seventh", SEVENTH, 5), ("eighth", EIGHTH, 5),
               ("ninth", NINTH, 5), ("tenth", TENTH, 5), ("eleventh", ELEVENTH, 7), ("twelfth", TWELFTH, 7),
               ("thirteenth", THIRTEENTH, 8), ("fourteenth", FOURTEENTH, 8), ("fifteenth", FIFTEENTH, 8),
               ("sixteenth", SIXTEENTH, 7), ("seventeenth", SEVENTEENTH, 8),
               ("eighteenth", EIGHTEENTH, 8)]
# Each blind collection with what came before it; ALL_SETS: every labelled record.
BLIND: list[tuple[str, list[dict], list[dict], int]] = []  # type: ignore[type-arg]
ALL_SETS = GIVEN + COLLECTED + UNSEEN + THIRD + FOURTH
for _name, _records, _negatives in _BLIND_SETS:
    BLIND.append((_name, _records, ALL_SETS, _negatives))
    ALL_SETS = ALL_SETS + _records


@pytest.mark.parametrize(("new", "earlier", "negatives"), [b[1:] for b in BLIND], ids=[b[0] for b in BLIND])
def test_a_blind_collection_is_split_by_url_hash_and_repeats_no_earlier_thread(
        new: list[dict], earlier: list[dict], negatives: int) -> None:  # type: ignore[type-arg]
    messages, urls = {r["message"].strip() for r in earlier}, {r["url"] for r in earlier}
    rule_text = builtin_serving_path().read_text(encoding="utf-8")
    for r in new:
        first = hashlib.sha256(r["url"].encode()).hexdigest()[0]
        assert r["split"] == ("tune" if first in "01234567" else "held_out"), r["id"]
        assert r["message"].strip() not in messages and r["url"] not in urls, r["id"]
        if r["split"] == "held_out":  # no rule example quotes a held-out thread
            assert re.search(re.escape(r["url"]) + r"(?!\d)", rule_text) is None, r["id"]
    assert len({r["url"] for r in new}) == len(new)
    assert sum(r["label"] == "not_oom" for r in new) >= negatives
    assert {r["split"] for r in new} == {"tune", "held_out"}


def test_the_sixth_collection_holds_25_to_40_memory_errors() -> None:
    assert 25 <= sum(r["label"] != "not_oom" for r in SIXTH) <= 40


@pytest.mark.parametrize(("before", "cls", "rule"), [
    ("", "unknown", "tgi.warmup.tokens/any-warmup-failure"),
    ("ERROR text_generation_launcher: Method Warmup encountered an error.\n"
     "ValueError: rope_scaling must be a dictionary with two fields\n", "unknown",
     "tgi.warmup.tokens/any-warmup-failure"),
    ("ERROR text_generation_launcher: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
     "GPU 0 has a total capacity of 22.05 GiB of which 1.10 GiB is free.\n", "capacity",
     "tgi.warmup.tokens/shard-oom-shown"),
])
def test_tgi_warmup_prefill_message_is_capacity_only_when_the_shard_printed_an_oom(before: str, cls: str,
                                                                                  rule: str) -> None:
    # TGI's Python warm-up raises this text from `except Exception:`: any failure of the first batch.
    text = before + ("RuntimeError: Not enough memory to handle 4096 prefill tokens. "
                     "You need to decrease `--max-batch-prefill-tokens`")
    found = [f for f in analyse(text) if f.rule.startswith("tgi.")]
    assert [(f.cls, f.rule) for f in found] == [(cls, rule)]
    if cls == "unknown":
        assert found[0].reason and "shard's own error" in found[0].reason


def test_floors_on_the_third_and_fourth_collections() -> None:
    fourth = score(FOURTH)
    assert fourth.false_alarms == 0 and fourth.unclear_unknown >= fourth.unclear / 2, fourth.misses
    assert fourth.recognised >= 0.8 * fourth.memory_errors, fourth.misses  # two print no memory words at all
    for half in ("tune", "held_out"):
        s6 = score([r for r in SIXTH if r["split"] == half])
        assert s6.false_alarms == 0 and s6.unclear_unknown >= s6.unclear / 2, (half, s6.misses)
        assert s6.recognised >= 0.9 * s6.memory_errors, (half, s6.misses)
        s5 = score([r for r in FIFTH if r["split"] == half])
        assert s5.false_alarms == 0 and s5.unclear_unknown >= s5.unclear / 2, (half, s5.misses)
        assert s5.recognised >= 0.9 * s5.memory_errors, (half, s5.misses)
        # c2-026 (tune, labelled unclear) holds TensorRT's builder warnings only, a skipped tactic: the
        # not_memory entry tensorrt.builder.tactic-skipped keeps it quiet (the builder goes on after them)
        s = score([r for r in THIRD if r["split"] == half and r["id"] != "c2-026"])
        assert s.recognised == s.memory_errors, (half, s.misses)
        assert s.false_alarms == 0, (half, s.misses)
        assert s.unclear_unknown >= s.unclear / 2, (half, s.misses)


def test_floors_on_the_unseen_messages() -> None:
    s = score([r for r in UNSEEN if not r["in_rule_examples"]])
    assert s.recognised == s.memory_errors, s.misses
    assert s.false_alarms == 0, s.misses
    assert s.unclear_unknown >= s.unclear / 2, s.misses


_MAX_LEN = ("ValueError: The model's max seq len ({n}) is larger than the maximum number of tokens that can be "
            "stored in KV cache ({kv}). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when "
            "initializing the engine.")


@pytest.mark.parametrize(("prefix", "n", "kv", "cls", "case"), [
    ("", 8192, 7900, "unknown", "within-fraction-headroom"),  # the fraction, not printed, decides a small gap
    ("", 8192, 6900, "unknown", "gap-undecided"),
    ("", 8192, 6500, "capacity", "far-beyond-pool"),
    ("", 32768, 16000, "capacity", "far-beyond-pool"),
    # the printed fraction decides, whatever the gap: at the default 0.9 only the length can move
    ("Memory profiling results: total_gpu_memory=23.58GiB kv_cache_size=2.89GiB gpu_memory_utilization=0.90\n",
     8192, 7900, "capacity", "default-fraction"),
])
def test_vllm_max_model_len_is_decided_by_the_fraction_or_the_overshoot(prefix: str, n: int, kv: int, cls: str,
                                                                       case: str) -> None:
    (f,) = analyse(prefix + _MAX_LEN.format(n=n, kv=kv))
    assert (f.cls, f.rule) == (cls, f"vllm.kv.max-model-len/{case}")
    if cls == "unknown":
        assert "gpu_memory_utilization" in (f.reason or "") and "--max-model-len" in (f.reason or "")


_TIGHT = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.16 GiB. GPU 0 has a total capacity of "
          "7.75 GiB of which 1.17 GiB is free. Including non-PyTorch memory, this process has 5.02 GiB memory in use. "
          "Of the allocated memory 4.81 GiB is allocated by PyTorch, and 18.97 MiB is reserved by PyTorch but "
          "unallocated.")


def test_a_rounding_margin_is_a_full_device_in_a_pool_engine_only() -> None:
    (bare,) = analyse(_TIGHT)
    assert (bare.engine, bare.cls) == ("pytorch", "fragmentation")  # the rubric's own tentative verdict
    (in_vllm,) = analyse("ERROR 03-13 09:00:43 [core.py:330] " + _TIGHT
                         + "\nCRITICAL 03-13 09:00:43 [core_client.py:260] Got fatal signal from worker processes")
    assert (in_vllm.engine, in_vllm.cls, in_vllm.rule) == ("vllm", "reservation_conflict", "oom.reservation.tenants")
    assert "not fragmentation" in in_vllm.note
    # a margin well above print rounding stays fragmentation inside an engine too
    roomy = _TIGHT.replace("Tried to allocate 1.16 GiB", "Tried to allocate 512.00 MiB")
    (f,) = analyse("(VllmWorkerProcess pid=1) ERROR " + roomy)
    assert (f.engine, f.cls) == ("vllm", "fragmentation")


def test_torch_npu_prints_its_total_in_the_old_format() -> None:
    (f,) = analyse("RuntimeError: NPU out of memory. Tried to allocate 3.47 GiB (NPU 0; 60.97 GiB total capacity; "
                   "58.92 GiB already allocated; 58.92 GiB current active; 1.66 GiB free; 58.95 GiB reserved in total "
                   "by PyTorch)")
    assert f.numbers["T"] == round(60.97 * 2**30)
    assert f.cls == "capacity"


def test_xla_bottom_reservation_with_free_printed_is_unknown() -> None:
    (f,) = analyse("RESOURCE_EXHAUSTED: Attempting to reserve 10.00G at the bottom of memory. That was not possible. "
                   "There are 6.00G free, 0B reserved, and 6.00G reservable.")
    assert (f.cls, f.rule) == ("unknown", "xla.program.reserve-bottom/free-below-request")
    assert "memory_stats" in (f.reason or "")


def test_tensorrt_builder_scratch_over_its_pool_is_unknown_with_the_numbers_in_the_reason() -> None:
    (f,) = analyse("[TRT] [E] 4: Internal error: plugin node GPTAttention_0 requires 56405524864 bytes of scratch "
                   "space, but only 47590277120 is available. Try increasing the workspace size with "
                   "IBuilderConfig::setMemoryPoolLimit().")
    assert (f.engine, f.cls) == ("tensorrt-llm", "unknown")
    assert f.rule == "tensorrt-llm.build.scratch-over-pool/pool-vs-device"
    assert f.numbers["R"] == 56405524864 and f.numbers["L"] == 47590277120
    assert "52.53 GiB" in (f.reason or "") and "{" not in (f.reason or "")


def test_reasons_name_the_printed_numbers_not_placeholders() -> None:
    (f,) = analyse("Server error: Not enough memory to handle 256 prefill tokens. You need to decrease")
    assert f.cls == "unknown" and "a prefill of 256 tokens" in (f.reason or "")


def test_a_reason_naming_an_unknown_quantity_does_not_load(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('''engine_version = "1.0"
[[rule]]
id = "x.y"
version = 1
engine = "vllm"
priority = 10
anchors = ["out of memory"]
mechanism = "a mechanism stated in enough words to pass the loader's check here"
class = "unknown"
reason = "needs {no_such_number}"
remedy = "r"
[[rule.examples]]
kind = "positive"
class = "unknown"
source = "a test"
text = "out of memory"
[[rule.examples]]
kind = "negative"
text = "fine"
''', encoding="utf-8")
    with pytest.raises(ServingRulesError, match="reason: unknown quantity 'no_such_number'"):
        load_serving_rules([bad])


def test_a_lowered_vllm_fraction_is_the_reservation() -> None:
    text = ("Memory profiling results: total_gpu_memory=79.10GiB gpu_memory_utilization=0.50\n"
            "ValueError: To serve at least one request with the models's max seq len (131072), (16.00 GiB KV cache is "
            "needed, which is larger than the available KV cache memory (9.50 GiB). Try increasing "
            "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.")
    (f,) = analyse(text)
    assert (f.cls, f.rule) == ("reservation_conflict", "vllm.kv.max-model-len/low-fraction")


def test_one_event_printed_on_several_lines_counts_once() -> None:
    found = analyse(next(r["message"] for r in GIVEN if r["id"] == "srv-042"))
    assert [f.rule for f in found] == ["tensorrt-llm.alloc.requested"]
    assert found[0].numbers["R"] == 69568823808
    doubled = analyse("\n".join([GIVEN[3]["message"]] * 3))
    assert len(doubled) == 1


# Two failures of one engine logged on consecutive lines (two engine cores of one vLLM server, two
# TGI warmups); the messages follow vLLM's kv_cache_utils.py and TGI's launcher, the sizes chosen here.
_VLLM_PREFIX = "ERROR 12-05 10:00:0%d [core.py:708] ValueError: "
_VLLM_NO_BLOCKS = ("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                   "initializing the engine.")
_VLLM_MAX_LEN = ("To serve at least one request with the models's max seq len (32768), (4.00 GiB KV cache is "
                 "needed, which is larger than the available KV cache memory (1.00 GiB). Based on the available "
                 "memory, the estimated maximum model length is 8192. Try increasing `gpu_memory_utilization` or "
                 "decreasing `max_model_len` when initializing the engine.")
_TGI_PREFILL = ("2024-01-01T00:00:0%dZ ERROR text_generation_launcher: Not enough memory to handle %d prefill "
                "tokens. You need to decrease `--max-batch-prefill-tokens`")


def test_two_errors_on_consecutive_lines_are_two_findings() -> None:
    """A rule's event ends on the last line its patterns read: the next line, when it holds an error of its own,
    is a second finding (it was taken as part of the first and lost, on every sink of the live path too)."""
    found = analyse(_VLLM_PREFIX % 0 + _VLLM_NO_BLOCKS + "\n" + _VLLM_PREFIX % 1 + _VLLM_MAX_LEN)
    assert [f.rule.split("/")[0] for f in found] == ["vllm.kv.no-cache-blocks", "vllm.kv.max-model-len"]
    assert [f.first_line for f in found] == [0, 1]
    two = analyse(_TGI_PREFILL % (0, 4096) + "\n" + _TGI_PREFILL % (1, 8192))
    assert [f.extra.get("prefill_tokens") for f in two] == [4096, 8192]
    # the same message on consecutive lines (logged and printed) is still one
    assert len(analyse(_TGI_PREFILL % (0, 4096) + "\n" + _TGI_PREFILL % (1, 4096))) == 1
    # and a closing line with no message of its own stays the event's (llama-server's dropped request)
    (kv,) = analyse("decode: failed to find a memory slot for batch of size 1\n"
                    "srv  update_slots: Context size has been exceeded. off = 0, n_batch = 1, ret = 1")
    assert kv.rule == "llama.cpp.kv-slots-full" and "batch of size 1" in kv.text


def test_engine_comes_from_the_log_around_a_pytorch_message() -> None:
    found = analyse(next(r["message"] for r in GIVEN if r["id"] == "srv-028"))
    assert [f.engine for f in found] == ["vllm", "vllm"]  # two NPUs, two messages
    assert all("In vLLM:" in f.remedy for f in found)
    assert detect_engine("Jan 26 ollama[1418]: ggml_backend_cuda_buffer_type_alloc_buffer") == "ollama"
    # TGI's router relays a shard's error through its gRPC client crate (router/client/src/lib.rs)
    relayed = ("2023-12-22T00:21:35.318928Z ERROR batch{batch_size=1}:prefill:prefill{id=1 size=1}: "
               "text_generation_client: router/client/src/lib.rs:33: Server error: CUDA out of memory. Tried to "
               "allocate 222.00 MiB. GPU 0 has a total capacty of 39.39 GiB of which 217.94 MiB is free.")
    (f,) = analyse(relayed)
    assert (f.engine, f.cls) == ("tgi", "unknown") and f.reason  # cut before A and P


def test_size_units() -> None:
    assert parse_bytes("15.65G") == round(15.65 * (1 << 30))
    assert parse_bytes("939524096") == 939524096
    assert parse_bytes("0.49", "GiB") == round(0.49 * (1 << 30))
    assert parse_bytes("lots") is None


# A rule file with errors: a pattern that backtracks (its line, 8, is named), a short mechanism, no reason.
_BAD_RULE_FILE = ('engine_version = "1.0"\n\n[[rule]]\nid = "x.y"\nversion = 1\nengine = "vllm"\n'
                  'anchors = ["out of memory"]\npatterns = [\'\'\'(a+)+\'\'\']\nmechanism = "too short"\n'
                  'class = "unknown"\nremedy = "r"\n')


def test_invalid_rule_file_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(_BAD_RULE_FILE, encoding="utf-8")
    with pytest.raises(ServingRulesError) as exc:
        load_serving_rules([bad])
    text = str(exc.value)
    assert f"{bad}:8:" in text and "backtracking" in text
    assert "mechanism" in text and "reason" in text and "positive and one negative" not in text


_QUIET_ENTRY = """
[[not_memory]]
id = "site.retry-warning"
engine = "vllm"
lines = ['\'\'retrying the allocation of [0-9]+ bytes\'\'']
mechanism = "the allocator retries after it frees its cache; a failure that stays raises its own error"
[[not_memory.examples]]
kind = "quiet"
source = "a site's own wrapper (format string)"
text = "allocator: CUDA error: out of memory, retrying the allocation of 4096 bytes"
[[not_memory.examples]]
kind = "found"
text = \"\"\"allocator: CUDA error: out of memory, retrying the allocation of 4096 bytes
ValueError: No available memory for the cache blocks.\"\"\"
"""


def test_a_not_memory_entry_keeps_its_lines_from_anchoring_and_is_checked(tmp_path: Path) -> None:
    good = tmp_path / "quiet.toml"
    good.write_text('engine_version = "1.0"\n' + _QUIET_ENTRY, encoding="utf-8")
    rs = load_serving_rules([builtin_serving_path(), good])
    assert [q.id for q in rs.not_memory][-1] == "site.retry-warning"
    line = "allocator: CUDA error: out of memory, retrying the allocation of 4096 bytes"
    assert analyse(line, rs) == [] and analyse(line)  # the builtin rules alone take it for a CUDA OOM
    (f,) = analyse(line + "\nValueError: No available memory for the cache blocks.", rs)
    assert f.rule.startswith("vllm.kv.no-cache-blocks")
    # an entry whose quiet example is still found, with no mechanism, or with no quiet example, does not load
    bad = tmp_path / "bad.toml"
    bad.write_text('engine_version = "1.0"\n' + _QUIET_ENTRY.replace('mechanism = "the allocator',
                                                                       'comment = "the allocator'), encoding="utf-8")
    with pytest.raises(ServingRulesError) as exc:
        load_serving_rules([builtin_serving_path(), bad])
    text = str(exc.value)
    assert f"{bad}:3:" in text and "unknown keys ['comment']" in text and "mechanism says why" in text
    bad.write_text('engine_version = "1.0"\n' + _QUIET_ENTRY.replace("retrying the allocation of [0-9]+ bytes",
                                                                       "never matches"), encoding="utf-8")
    with pytest.raises(ServingRulesError, match="quiet example gave gpu.cuda-runtime-oom"):
        load_serving_rules([builtin_serving_path(), bad])
    none = tmp_path / "none.toml"
    none.write_text('engine_version = "1.0"\n' + _QUIET_ENTRY.replace('kind = "quiet"', 'kind = "found"'),
                    encoding="utf-8")
    with pytest.raises(ServingRulesError, match="needs a quiet example"):
        load_serving_rules([builtin_serving_path(), none])


def test_the_builtin_not_memory_entries_hold_their_examples() -> None:
    rs = load_serving_rules([builtin_serving_path()])
    assert {q.id for q in rs.not_memory} >= {"tensorrt.builder.tactic-skipped", "xla.bfc.tolerated-failure",
                                            "xla.triton.shared-memory", "ggml.pinned-host-fallback",
                                            "llama.cpp.mlock-limit"}
    assert rs.check_not_memory() == []
    for q in rs.not_memory:
        assert len(q.mechanism.split()) >= 8 and any(e.kind == "quiet" for e in q.examples), q.id


_RETRIED = ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 808.35 MiB on device 1: cudaMalloc failed: "
            "out of memory\nggml_gallocr_reserve_n: failed to allocate CUDA1 buffer of size 847617024\n"
            "graph_reserve: failed to allocate compute buffers\n"
            "sched_reserve: compute buffer allocation failed, retrying without pipeline parallelism")


def test_a_failure_the_engine_retried_is_no_memory_error_but_a_failed_retry_is_found_once() -> None:
    assert analyse(_RETRIED) == []
    # the claimed lines are those right before the retry line: an earlier, separate failure is still found
    earlier = "llama_kv_cache_init: failed to allocate buffer for kv cache\nllama_context: pipeline parallelism enabled"
    (f,) = analyse(earlier + "\n" + _RETRIED)
    assert f.first_line == 0 and f.engine == "llama.cpp"
    # as is the retry's own failure after it, once (its closing line joins the allocation it follows)
    failed = (_RETRIED + "\nggml_backend_cuda_buffer_type_alloc_buffer: allocating 408.09 MiB on device 1: cudaMalloc"
              " failed: out of memory\nggml_gallocr_reserve_n: failed to allocate CUDA1 buffer of size 427909632\n"
              "graph_reserve: failed to allocate compute buffers\n"
              "llama_init_from_model: failed to initialize the context: failed to allocate compute pp buffers")
    (f,) = analyse(failed)
    assert f.first_line == 4 and f.numbers["R"] == 427909632


_PURGED = ("decode: failed to find a memory slot for batch of size 2048\n"
           "srv  try_clear_id: purging slot 1 with 6143 tokens\n"
           "slot  prompt_clear: id  1 | task -1 | clearing prompt with 6143 tokens\n"
           "srv  update_slots: failed to find free space in the KV cache, retrying with smaller batch size, i = 0, "
           "n_batch = 2048, ret = 1")


def test_a_kv_batch_retried_after_llama_cpp_purged_an_idle_slot_is_no_memory_error() -> None:
    # llama-server with a unified KV cache frees an idle slot's cells between the failure and its retry line
    assert analyse(_PURGED) == []
    # without the retry line the failure is found; a line between them that is no recovery step keeps it found
    (f,) = analyse(_PURGED.rsplit("\n", 1)[0])
    assert f.rule == "llama.cpp.kv-slots-full"
    lines = _PURGED.split("\n")
    (f,) = analyse("\n".join([lines[0], "srv  log_server_r: request: POST /completion 200", *lines[1:]]))
    assert f.rule == "llama.cpp.kv-slots-full" and f.first_line == 0
    # the recovery lines are passed over for at most a window's worth (8 lines)
    assert analyse("\n".join([lines[0], *(lines[1:3] * 4), lines[3]])) == []
    (f,) = analyse("\n".join([lines[0], *(lines[1:3] * 4), lines[1], lines[3]]))
    assert f.first_line == 0


def test_a_recovery_line_is_checked_and_one_with_a_needle_anchors_nothing_either(tmp_path: Path) -> None:
    between = "retried_lines_before = 1\nretried_between = ['freed [0-9]+ bytes of cached memory']\n"
    entry = _QUIET_ENTRY.replace('mechanism = "the allocator', between + 'mechanism = "the allocator')
    site = tmp_path / "quiet.toml"
    site.write_text('engine_version = "1.0"\n' + entry, encoding="utf-8")
    rs = load_serving_rules([builtin_serving_path(), site])
    failed = "ValueError: No available memory for the cache blocks."
    freed = "allocator: freed 1048576 bytes of cached memory"
    retry = "allocator: CUDA error: out of memory, retrying the allocation of 4096 bytes"
    # the recovery line holds a needle ("memory") but is the engine's own step: neither it nor the failure is found
    assert analyse("\n".join([failed, freed, retry]), rs) == []
    (f,) = analyse("\n".join([failed, freed]), rs)  # no retry: the failure is found
    assert f.rule.startswith("vllm.kv.no-cache-blocks")
    # a pattern that matches an empty line would pass over anything: refused
    site.write_text('engine_version = "1.0"\n' + entry.replace("freed [0-9]+ bytes of cached memory", "(?:freed)?"),
                    encoding="utf-8")
    with pytest.raises(ServingRulesError, match="retried_between pattern matches an empty line"):
        load_serving_rules([builtin_serving_path(), site])


def test_retried_lines_before_is_checked(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('engine_version = "1.0"\n' + _QUIET_ENTRY.replace(
        'mechanism = "the allocator', 'retried_lines_before = 99\nmechanism = "the allocator'), encoding="utf-8")
    with pytest.raises(ServingRulesError, match=r"retried_lines_before must be 0\.\.16 lines"):
        load_serving_rules([builtin_serving_path(), bad])
    bad.write_text('engine_version = "1.0"\n' + _QUIET_ENTRY.replace(
        'mechanism = "the allocator', "retried_between = ['slot \\\\d+ freed']\nmechanism = \"the allocator"),
        encoding="utf-8")
    with pytest.raises(ServingRulesError, match=r"retried_between is a list of regular expressions, with "
                                                r"retried_lines_before"):
        load_serving_rules([builtin_serving_path(), bad])


_REFUSED = ("llama_init_from_model: V cache quantization requires flash_attn\n"
            "common_init_from_params: failed to create context with model 'models/gemma-3-12b-it-q4_0.gguf'")


def test_a_context_llama_cpp_refused_for_a_setting_is_no_memory_error() -> None:
    # llama_init_from_model refuses a quantised V cache without flash attention before it allocates anything;
    # its caller's "failed to create context" is the setting's, whichever wording of the refusal came first
    assert analyse(_REFUSED) == []
    newer = ("llama_init_from_model: failed to initialize the context: quantized V cache was requested, but this "
             "requires Flash Attention\ncommon_init_from_params: failed to create context with model 'm.gguf'")
    assert analyse(newer) == []
    refusal, failed = _REFUSED.split("\n")
    # the refusal at most 6 lines before: further away, or none, the failure is found again
    assert analyse("\n".join([refusal, *["llama_context: n_ctx = 4096"] * 5, failed])) == []
    (f,) = analyse("\n".join([refusal, *["llama_context: n_ctx = 4096"] * 6, failed]))
    assert f.rule == "llama.cpp.context-create"
    (f,) = analyse(failed)
    assert f.rule == "llama.cpp.context-create" and f.cls == "unknown"
    # a memory error beside the refusal is found all the same
    oom = ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 8192.00 MiB on device 0: cudaMalloc failed: "
           "out of memory")
    (f,) = analyse(_REFUSED + "\n" + oom)
    assert f.engine == "llama.cpp" and f.numbers["R"] == 8192 << 20


def test_ends_in_is_checked(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('engine_version = "1.0"\n' + _QUIET_ENTRY.replace(
        'mechanism = "the allocator', "ends_in = ['failed to create context']\nmechanism = \"the allocator"),
        encoding="utf-8")
    with pytest.raises(ServingRulesError, match="ends_in is a list of regular expressions, with ends_in_lines_after"):
        load_serving_rules([builtin_serving_path(), bad])
    bad.write_text('engine_version = "1.0"\n' + _QUIET_ENTRY.replace(
        'mechanism = "the allocator', "ends_in = ['(?:x)?']\nends_in_lines_after = 2\nmechanism = \"the allocator"),
        encoding="utf-8")
    with pytest.raises(ServingRulesError, match="an ends_in pattern matches an empty line"):
        load_serving_rules([builtin_serving_path(), bad])
    bad.write_text('engine_version = "1.0"\n' + _QUIET_ENTRY.replace(
        'mechanism = "the allocator', "ends_in = ['x']\nends_in_lines_after = 99\nmechanism = \"the allocator"),
        encoding="utf-8")
    with pytest.raises(ServingRulesError, match=r"ends_in_lines_after must be 0\.\.16 lines"):
        load_serving_rules([builtin_serving_path(), bad])
    # the count alone does nothing: refused; with 0 the refusal must be on the failure's own line
    bad.write_text('engine_version = "1.0"\n' + _QUIET_ENTRY.replace(
        'mechanism = "the allocator', "ends_in_lines_after = 2\nmechanism = \"the allocator"), encoding="utf-8")
    with pytest.raises(ServingRulesError, match="ends_in is a list of regular expressions, with ends_in_lines_after"):
        load_serving_rules([builtin_serving_path(), bad])
    retry = "allocator: CUDA error: out of memory, retrying the allocation of 4096 bytes"
    failed = "ValueError: No available memory for the cache blocks."
    for after, found in ((0, ["vllm.kv.no-cache-blocks"]), (1, [])):  # 0: the failure's own line only
        good = tmp_path / f"good{after}.toml"
        good.write_text('engine_version = "1.0"\n' + _QUIET_ENTRY.replace(
            'mechanism = "the allocator', "ends_in = ['No available memory for the cache blocks']\n"
            f"ends_in_lines_after = {after}\nmechanism = \"the allocator").replace(
            'kind = "found"', 'kind = "found"' if after == 0 else 'kind = "quiet"\nsource = "the same wrapper"'),
            encoding="utf-8")
        rs = load_serving_rules([builtin_serving_path(), good])
        assert [f.rule.split("/")[0] for f in analyse(retry + "\n" + failed, rs)] == found


def test_without_examples_a_file_loads_without_its_line_index_and_an_error_still_names_its_line(
        tmp_path: Path) -> None:
    fast = load_serving_rules(run_examples=False)  # the builtin file, as a process loads it
    assert fast.rules and {r.where.line for r in fast.rules} == {0}  # no index built
    assert [r.id for r in fast.rules] == [r.id for r in load_serving_rules().rules]
    bad = tmp_path / "bad.toml"
    bad.write_text(_BAD_RULE_FILE, encoding="utf-8")
    with pytest.raises(ServingRulesError) as exc:
        load_serving_rules([bad], run_examples=False)
    assert f"{bad}:8:" in str(exc.value)  # loaded again with the index for the message


def test_a_rule_table_s_keys_id_and_version_are_checked_with_their_lines(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('engine_version = "1.0"\n\n[[rule]]\nid = "Not-Lower"\nversion = 0\nengine = "vllm"\n'
                   'colour = "red"\n', encoding="utf-8")
    with pytest.raises(ServingRulesError) as exc:
        load_serving_rules([bad])
    text = str(exc.value)
    assert f"{bad}:7: unknown rule key 'colour'" in text
    assert f"{bad}:4: rule id must be lower-case letters" in text
    assert f"{bad}:5: <rule 1>: version must be a positive integer" in text


def test_a_rule_whose_example_fails_does_not_load(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('''engine_version = "1.0"
[[rule]]
id = "x.y"
version = 1
engine = "vllm"
anchors = ["No available memory for the cache blocks"]
mechanism = "a mechanism described in enough words to pass the check"
class = "capacity"
remedy = "r"
[[rule.examples]]
kind = "positive"
source = "s"
text = "No available memory for the cache blocks"
[[rule.examples]]
kind = "negative"
text = "No available memory for the cache blocks, again"
''', encoding="utf-8")
    with pytest.raises(ServingRulesError, match="negative example fired"):
        load_serving_rules([bad])


def test_the_pytorch_corpus_keeps_its_verdicts_through_analyse() -> None:
    """The engine rules never take a PyTorch allocator message from the rubric: every message
    of oom_examples.jsonl gives, as its first result, the rubric's own verdict."""
    from infersight.rules.engine import classify_message
    from infersight.rules.oom_parse import find_ooms

    rows = _load("oom_examples.jsonl")
    same = 0
    for r in rows:
        first = analyse(r["text"])[0]
        want = classify_message(find_ooms(r["text"])[0])
        assert first.message is not None, r["id"]
        assert (first.cls, first.rule) == (want.cls, want.rule), r["id"]
        same += bool(r["clear"]) and first.cls == r["label"]
    clear = sum(1 for r in rows if r["clear"])
    assert same >= 0.99 * clear  # the clear ones keep their labels (DESIGN: 99%)


@pytest.mark.parametrize("seed", range(20))
def test_hostile_text_never_raises_and_stays_bounded(seed: int) -> None:
    import random

    rng = random.Random(seed)
    pieces = [a for rule in builtin().rules for a in rule.anchors] + [
        "\n", " ", "(", ")", "0", "9" * 30, "GiB", "\\n", "&amp;", "[TM][", "ollama", "vllm", "Tried to allocate ",
        "x" * 5000, "\u202e", "\x00",
    ]
    text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 4000)))
    found = analyse(text)
    assert len(found) <= 2 * 256
    for f in found:
        assert f.engine in ENGINES
        assert f.cls != "unknown" or f.reason
        json.dumps(f.to_json())


_ARENA = ("Non-zero status code returned while running Conv node. Name:'Conv_3' Status Message: "
          "/onnxruntime_src/onnxruntime/core/framework/bfc_arena.cc:376 void* "
          "onnxruntime::BFCArena::AllocateRawInternal(size_t, bool, onnxruntime::Stream*, bool, "
          "onnxruntime::WaitNotificationFn) Failed to allocate memory for "
          "requested buffer of size 643840")


def test_onnxruntime_bare_arena_failure_is_the_arena_unless_triton_shares_the_gpu() -> None:
    # the default kNextPowerOfTwo arena holds the device in doubled regions it never returns: the
    # remedy is the allocator setting (kSameAsRequested), fragmentation by the rubric
    (f,) = analyse(_ARENA)
    assert (f.engine, f.cls, f.knob, f.numbers["R"]) == ("onnxruntime", "fragmentation", "arena_extend_strategy",
                                                          643840)
    assert "kSameAsRequested" in f.remedy and "kSameAsRequested" in f.note
    (f,) = analyse("onnx runtime error 6: " + _ARENA)
    assert (f.cls, f.rule) == ("reservation_conflict", "onnxruntime.arena.extend-failed/shared-server")
    # Triton's relay on the line before a wrapped failure line still names the shared server
    (f,) = analyse("UNAVAILABLE: Internal: onnx runtime error 6: Non-zero status code returned while running Mul "
                   "node. onnxruntime::BFCArena::AllocateRawInternal(size_t, bool)\n"
                   "Failed to allocate memory for requested buffer of size 268435456 |")
    assert (f.cls, f.numbers["R"]) == ("reservation_conflict", 268435456)
    # while the session is initialised the model's own weights failed to load: with or without other tenants,
    # the text does not say (in Triton too)
    (f,) = analyse("UNAVAILABLE: Internal: onnx runtime error 6: Exception during initialization: "
                   "onnxruntime::BFCArena::AllocateRawInternal(size_t, bool)\n"
                   "Failed to allocate memory for requested buffer of size 268435456 |")
    assert (f.cls, f.rule, f.numbers["R"]) == ("unknown", "onnxruntime.arena.extend-failed/initialization", 268435456)
    assert "initial" in (f.reason or "")
    # the arena's name alone, with no failure, is no memory error
    assert analyse("onnxruntime::BFCArena::AllocateRawInternal extended the arena by 1048576 bytes") == []


def test_xla_runtime_allocation_with_less_free_than_requested_does_not_say_whose_buffers_hold_the_rest() -> None:
    # the live buffers may be the program's own (weights too large for HBM) or an earlier run's: not decided
    (f,) = analyse("XlaRuntimeError: RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate "
                   "15.65G. That was not possible. There are 11.08G free.; (0x0x0_HBM0)")
    assert (f.cls, f.rule) == ("unknown", "xla.alloc.not-possible/held-by-live-buffers")
    assert "15.65 GiB was requested with 11.08 GiB free" in (f.reason or "")
    assert "memory_stats()" in (f.reason or "")
    (f,) = analyse("RESOURCE_EXHAUSTED: Attempting to allocate 2.00G. That was not possible. There are 5.31G free. "
                   "Due to fragmentation, the largest contiguous region of free memory is 1.50G")
    assert f.cls == "fragmentation"
    (f,) = analyse("RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 8.00G. That was not "
                   "possible.")
    assert f.cls == "unknown" and f.reason


_NPU_OLD = ("(VllmWorkerProcess pid=20493) ERROR 03-05 07:15:39 multiproc_worker_utils.py:240] RuntimeError: NPU out "
            "of memory. Tried to allocate 22.00 MiB (NPU 6; 60.97 GiB total capacity; 10.24 GiB already allocated; "
            "10.24 GiB current active; 19.79 MiB free; 10.65 GiB reserved in total by PyTorch)")


def test_an_engine_whose_device_is_mostly_held_elsewhere_is_not_fragmentation() -> None:
    # 50 GiB of a 61 GiB NPU outside this process's allocator, 420 MiB cached: in an engine's log the
    # memory held elsewhere is what the engine lacks
    (f,) = analyse(_NPU_OLD)
    assert (f.engine, f.cls) == ("vllm", "reservation_conflict") and "held outside" in f.note
    # a plain PyTorch program keeps the rubric's fragmentation-first order (the PyTorch corpus's labels)
    plain = _NPU_OLD.split("] ", 1)[1]
    (f,) = analyse(plain)
    assert (f.engine, f.cls) == ("pytorch", "fragmentation")
    # in the engine's log with the device held by this process's own cache (20 GiB of it cached, live
    # tensors on 66% of the device), fragmentation stays
    own = _NPU_OLD.replace("10.65 GiB reserved", "60.00 GiB reserved").replace("10.24 GiB already", "40.00 GiB already")
    (f,) = analyse(own)
    assert f.cls == "fragmentation"


@pytest.mark.parametrize(("text", "needed", "room"), [
    ("ggml_allocr_alloc: not enough space in the buffer (needed 561259008, largest block available 102924288)",
     561259008, ("largest_free_bytes", 102924288)),
    ("ggml_tallocr_alloc: not enough space in the buffer to allocate blk.17.ffn_down.weight (needed 27525120, "
     "available 27521024)", 27525120, ("pool_size_bytes", 27521024)),
    ("ggml_dyn_tallocr_alloc: not enough space in the buffer to allocate 268435456 bytes, largest block available "
     "134217728 bytes", 268435456, ("largest_free_bytes", 134217728)),
])
def test_ggml_tensor_allocator_buffer_is_the_engines_own_sizing(text: str, needed: int, room: tuple[str, int]) -> None:
    # the buffer was sized by ggml's own measure: neither RAM nor VRAM was asked, and the largest free block
    # does not tell a split free list from a short estimate
    (f,) = analyse(text + '\nGGML_ASSERT: ggml-alloc.c:114: !"not enough space in the buffer"')
    assert (f.engine, f.cls, f.rule) == ("llama.cpp", "unknown", "ggml.tensor-allocator-buffer")
    assert f.extra["pool_needed_bytes"] == needed and f.extra[room[0]] == room[1]
    assert f.reason and "not a shortage of RAM or VRAM" in f.reason
    assert analyse("ggml_gallocr_reserve_n: reallocating CUDA0 buffer from size 0.00 MiB to 1580.00 MiB") == []


_VLLM_LOAD = ("(EngineCore pid=3670) ERROR 04-07 15:58:28 [gpu_model_runner.py:4818] Failed to load model - not enough "
              "GPU memory. Try lowering --gpu-memory-utilization to free memory for weights, increasing "
              "--tensor-parallel-size, or using --quantization. See https://docs.vllm.ai/en/latest/configuration/"
              "conserving_memory/ for more tips. (original error: CUDA out of memory. Tried to allocate 112.00 MiB. "
              "GPU 0 has a total capacity of 31.36 GiB of which 53.06 MiB is free. Including non-PyTorch memory, this "
              "process has 31.30 GiB memory in use.{others} Of the allocated memory 30.35 GiB is allocated by "
              "PyTorch, and 319.13 MiB is reserved by PyTorch but unallocated.)")


def test_a_vllm_weight_load_oom_is_capacity_unless_another_process_holds_the_device() -> None:
    # vLLM's load-phase line (gpu_model_runner.load_model): the weights fill the card; the 319 MiB cached would
    # make the bare rubric say fragmentation
    (f,) = analyse(_VLLM_LOAD.format(others=""))
    assert (f.engine, f.cls, f.rule, f.knob) == ("vllm", "capacity", "vllm.load.weights-exceed-device",
                                                 "tensor_parallel_size")
    assert "31.30 GiB of the 31.36 GiB" in f.note and "--tensor-parallel-size" in f.remedy
    assert "--max-model-len" not in f.remedy  # the KV cache is not sized yet: its knobs are not the remedy
    # another process holds 9 GiB: one started after the engine's start-up check
    (f,) = analyse(_VLLM_LOAD.format(others=" Process 4242 has 9.00 GiB memory in use.")
                   .replace("31.30 GiB memory in use", "22.30 GiB memory in use"))
    assert (f.engine, f.cls) == ("vllm", "reservation_conflict") and "started after" in f.note
    # the load-phase line after the traceback's last line, with an em dash, no word "vllm" anywhere
    (f,) = analyse("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1008.00 MiB.\n"
                   "GPU 2 has a total capacity of 79.19 GiB of which 993.44 MiB is free.\n"
                   "[gpu_model_runner.py:4957] Failed to load model \u2014 not enough GPU memory.")
    assert (f.engine, f.cls) == ("vllm", "capacity") and "78.22 GiB of the 79.19 GiB" in f.note
    # the same PyTorch message outside the load phase keeps the rubric
    (f,) = analyse(_VLLM_LOAD.format(others="").split("(original error: ", 1)[1])
    assert (f.engine, f.cls) == ("pytorch", "fragmentation")


def test_the_allocators_recoverable_retry_warning_is_no_memory_error() -> None:
    # PyTorch 2.13 logs it on every failed cudaMalloc attempt, those it recovers from included (pytorch#193195)
    warning = ("[rank1]:[W812 16:00:28.643448608 CUDACachingAllocator.cpp:3933] memory allocation failed with OOM on "
               "device 1 while trying to allocate 20971520 bytes (free: 15794176, total: 150111977472).")
    assert analyse(warning) == []


def test_a_request_larger_than_the_device_is_capacity_even_when_cut() -> None:
    # dots.ocr#179 under vLLM: the message cut after the free bytes still decides it
    (f,) = analyse("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 74.16 GiB. GPU 0 has a total "
                   "capacity of 47.51 GiB of which 22.65 GiB is free.")
    assert (f.cls, f.rule) == ("capacity", "oom.capacity.beyond-device") and "larger than the whole device" in f.note
    (f,) = analyse("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.16 GiB. GPU 0 has a total "
                   "capacity of 47.51 GiB of which 2.65 GiB is free.")
    assert f.cls == "unknown" and f.reason


_OLLAMA = "Error: model requires more system memory ({r}) than is available ({f})"
_OLLAMA_WARN = ('time=2026-03-25T09:45:06.861Z level=WARN source=server.go:1044 msg="model request too large for '
                'system" requested="{r}" available="{f}" total="{t}" free="{f}" swap="0 B"\n')


@pytest.mark.parametrize(("warn", "r", "f", "t", "cls", "case"), [
    (False, "5.0 GiB", "3.9 GiB", "", "unknown", ""),  # free memory only: the machine's size is missing
    (False, "44.0 GiB", "7.6 GiB", "", "capacity", "/far-beyond-free"),
    (True, "5.3 GiB", "4.8 GiB", "10.0 GiB", "reservation_conflict", "/held-by-others"),
    (True, "12.0 GiB", "4.8 GiB", "10.0 GiB", "capacity", "/exceeds-machine"),
])
def test_ollama_system_memory_is_decided_by_the_machine_total(warn: bool, r: str, f: str, t: str, cls: str,
                                                              case: str) -> None:
    text = (_OLLAMA_WARN.format(r=r, f=f, t=t) if warn else "") + _OLLAMA.format(r=r, f=f)
    (found,) = analyse(text)
    assert (found.engine, found.cls, found.rule) == ("ollama", cls, "ollama.system-memory" + case)
    if cls == "unknown":
        assert "total=" in (found.reason or "")
    if warn:
        assert found.numbers["T"] == parse_bytes(t)


_CAPTURE_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 112.00 MiB. GPU 0 has a total "
                "capacity of 44.35 GiB of which 53.38 MiB is free. Process 3663367 has 44.28 GiB memory in use. Of the "
                "allocated memory 37.38 GiB is allocated by PyTorch, and 275.68 MiB is reserved by PyTorch but "
                "unallocated.")


def test_a_pytorch_oom_during_cuda_graph_capture_is_the_engine_budget() -> None:
    capturing = ("INFO 02-03 03:43:49 model_runner.py:625] Capturing the model for CUDA graphs. This may lead to "
                 "unexpected consequences if the model is not static. To run the model in eager mode, set "
                 "'enforce_eager=True' or use '--enforce-eager' in the CLI.\n")
    (f,) = analyse(capturing + "ERROR 02-03 03:44:03 engine.py:190] " + _CAPTURE_OOM)
    assert (f.engine, f.cls, f.rule, f.knob) == ("vllm", "reservation_conflict", "vllm.cuda-graph-capture",
                                                 "gpu_memory_utilization")
    assert "CUDA graphs" in f.note and "In vLLM:" in f.remedy
    # newest-first collectors print the capture line after the error
    (f,) = analyse("ERROR 02-03 03:44:03 engine.py:190] " + _CAPTURE_OOM + "\n" + capturing)
    assert f.rule == "vllm.cuda-graph-capture"
    # a capture that finished before the error does not decide it: the rubric's own verdict stays
    done = capturing + "INFO 02-03 03:44:00 model_runner.py:1500] Graph capturing finished in 5 secs, took 0.50 GiB\n"
    (f,) = analyse(done + "ERROR 02-03 03:44:03 engine.py:190] " + _CAPTURE_OOM)
    assert (f.cls, f.rule) == ("fragmentation", "oom.fragmentation")
    (f,) = analyse("[2024-10-22 06:31:49 TP0] Capture cuda graph begin. This can take up to several minutes.\n"
                   + _CAPTURE_OOM)
    assert (f.engine, f.rule, f.knob) == ("sglang", "sglang.cuda-graph-capture", "mem-fraction-static")


def test_fragmentation_in_an_engines_full_device_names_the_pool_fraction_as_the_next_step() -> None:
    # 275.68 MiB cached + 53.38 MiB free of 44.35 GiB: the rubric's fragmentation, in a device vLLM's pools filled
    (f,) = analyse("(EngineCore pid=1) ERROR " + _CAPTURE_OOM)
    assert (f.engine, f.cls, f.rule) == ("vllm", "fragmentation", "oom.fragmentation")
    assert "only 329.06 MiB (0.7% of the device) was cached or free" in f.note
    assert f.note.endswith("lower --gpu-memory-utilization")
    # the same numbers in a plain PyTorch program, or slack over 5% of the device: the rubric's note alone
    (f,) = analyse(_CAPTURE_OOM)
    assert (f.engine, f.cls) == ("pytorch", "fragmentation") and "pools" not in f.note
    roomy = _CAPTURE_OOM.replace("275.68 MiB is reserved", "3.00 GiB is reserved")
    (f,) = analyse("[2025-01-01 00:00:00 TP0] sglang scheduler\n" + roomy)
    assert (f.engine, f.cls) == ("sglang", "fragmentation") and "pools" not in f.note


def test_vllm_naming_its_cuda_graph_memory_estimate_marks_the_capture() -> None:
    # vLLM >= 0.21 names the estimate's switch when it sizes the KV cache just before capturing, and in the
    # advice it adds to a capture OOM (vllm#57475); a PyTorch OOM there is the gpu_memory_utilization budget's
    cut = ("Tried to allocate 136.00 MiB. GPU 0 has a total capacity of 22.36 GiB of which 120.88 MiB is free. ... "
           "If this problem persists, try setting VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0")
    (f,) = analyse(cut)
    assert (f.engine, f.cls, f.rule, f.knob) == ("vllm", "reservation_conflict", "vllm.cuda-graph-capture",
                                                 "gpu_memory_utilization")
    sizing = ("(EngineCore pid=111) INFO 06-07 08:56:43 [gpu_worker.py:481] CUDA graph memory profiling is enabled "
              "(default since v0.21.0). The current --gpu-memory-utilization=0.9000 is equivalent to "
              "--gpu-memory-utilization=0.8667 without CUDA graph memory profiling. To disable, set "
              "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0.\n")
    (f,) = analyse(sizing + "(EngineCore pid=111) ERROR " + _CAPTURE_OOM)
    assert f.rule == "vllm.cuda-graph-capture"
    # once capture finished, a later OOM is the rubric's again
    done = sizing + "(EngineCore pid=111) INFO [gpu_model_runner.py:6456] Graph capturing finished in 5 secs\n"
    (f,) = analyse(done + "(EngineCore pid=111) ERROR " + _CAPTURE_OOM)
    assert (f.cls, f.rule) == ("fragmentation", "oom.fragmentation")
    # without the marker the cut message decides nothing
    (f,) = analyse(cut.split(" ... ", maxsplit=1)[0])
    assert f.cls == "unknown"


@pytest.mark.parametrize(("component", "free", "cls", "rule"), [
    ("Model", "78.52", "capacity", "/model-exceeds-device"),
    ("Model", "60.00", "unknown", "/model"),
    ("KV cache", "70.00", "unknown", "/kv-cache"),
    ("Model resources created during usage", "70.00", "unknown", "/runtime-stage"),
])
def test_tensorrt_llm_executor_stage_decides_only_the_weights_on_a_free_device(component: str, free: str, cls: str,
                                                                               rule: str) -> None:
    text = ("[TRT-LLM] [E] Executor creation failed due to insufficient GPU memory.\n\n"
            f"The following component could not be created: {component}\nTotal GPU memory (GiB): 79.11\n"
            f"Free GPU memory before component creation attempt (GiB): {free}\n")
    (f,) = analyse(text)
    assert (f.engine, f.cls, f.rule) == ("tensorrt-llm", cls, "tensorrt-llm.executor.insufficient-memory" + rule)
    assert f.numbers["T"] == parse_bytes("79.11 GiB") and f.numbers["F"] == parse_bytes(free + " GiB")
    if cls == "unknown":
        assert f.reason and len(f.reason.split()) >= 8


def test_xla_async_allocator_prints_free_total_and_in_use() -> None:
    head = ("E0101 00:00:00.000000 1 gpu_cudamallocasync_allocator.cc:361] gpu_async_0 cuMemAllocAsync failed to "
            "allocate {r} bytes: RESOURCE_EXHAUSTED: : CUDA_ERROR_OUT_OF_MEMORY: out of memory\n"
            " Reported by CUDA: Free memory/Total memory: 1073741824/85095874560\n"
            "E0101 00:00:00.000001 1 gpu_cudamallocasync_allocator.cc:366] Stats: Limit:                0\n"
            "InUse:                     {a}")
    (f,) = analyse(head.format(r=4294967296, a=82000000000))
    assert (f.engine, f.cls, f.rule) == ("xla", "capacity", "xla.gpu.async-allocator/own-buffers")
    assert (f.numbers["F"], f.numbers["T"], f.numbers["A"]) == (1073741824, 85095874560, 82000000000)
    (f,) = analyse(head.format(r=4294967296, a=20000000000))
    assert f.rule == "xla.gpu.async-allocator/held-elsewhere"
    (f,) = analyse(head.format(r=1225195446464, a=61982909300))
    assert (f.cls, f.rule) == ("unknown", "xla.gpu.async-allocator/implausible-size")


def test_a_vllm_error_wrapped_by_the_terminal_keeps_its_numbers() -> None:
    (f,) = analyse("(EngineCore pid=1) ValueError: To serve at least one request with the model's max seq len "
                   "(100000), (9.00 GiB KV cach\ne is needed, which is larger than the available KV cache memory "
                   "(4.00 GiB).")
    assert (f.cls, f.rule) == ("capacity", "vllm.kv.max-model-len/far-beyond-pool")
    assert f.extra["max_model_len"] == 100000 and f.extra["kv_available_bytes"] == 4 << 30


def test_tensorrt_builder_warnings_alone_are_no_memory_error() -> None:
    (c2_026,) = [r for r in THIRD if r["id"] == "c2-026"]
    assert "Skipping tactic" in c2_026["message"] and analyse(c2_026["message"]) == []


def test_tensorrt_formats_across_versions() -> None:
    (f,) = analyse("[TensorRT] ERROR: Requested amount of memory (150994944 bytes) could not be allocated. There may "
                   "not be enough free memory for allocation to succeed.")
    assert (f.engine, f.cls, f.numbers["R"]) == ("tensorrt-llm", "unknown", 150994944)
    (f,) = analyse("[E] [virtualMemoryBuffer.cpp::resizePhysical::140] Error code 2: out of Memory (Requested size "
                   "was 22942842880 bytes.)")
    assert (f.cls, f.numbers["R"]) == ("unknown", 22942842880)
    warned = ("WARNING: [TRT]: Requested amount of GPU memory (4294967296 bytes) could not be allocated. There "
              "may not be enough free memory for allocation to succeed.\nTry decreasing the workspace size with "
              "IBuilderConfig::setMemoryPoolLimit().")
    assert analyse(warned) == []  # the builder's warnings alone: it skips the tactic and times the next one
    (f,) = analyse("ERROR: [TRT]: 2: [virtualMemoryBuffer.cpp::resizePhysical::145] Error Code 2: OutOfMemory (no "
                   "further information)\n" + warned)
    assert (f.cls, f.rule) == ("reservation_conflict", "tensorrt-llm.alloc.requested/workspace-pool")
    trt = "../rtSafe/safeRuntime.cpp (25) - Cuda Error in allocate: 2 (out of memory)"
    (f,) = analyse("[E] [TRT] " + trt)
    assert (f.engine, f.cls, f.rule, f.knob) == ("tensorrt-llm", "reservation_conflict", "tensorrt.cuda-error",
                                                 "workspace size")
    (f,) = analyse("E:onnxruntime:Default, tensorrt_execution_provider.h:50 log] [ERROR] " + trt)
    assert (f.engine, f.rule) == ("onnxruntime", "tensorrt.cuda-error")  # ONNX Runtime's TensorRT provider
    (f,) = analyse("failed to load 'tensorrt_llm' version 1: Internal: unexpected error when creating "
                   "modelInstanceState: [TensorRT-LLM][ERROR] CUDA runtime error in ::cudaMalloc(ptr, n): "
                   "out of memory")
    assert (f.engine, f.rule) == ("tensorrt-llm", "tensorrt-llm.cuda-runtime")


def test_a_full_llama_cpp_kv_cache_is_not_a_device_shortage() -> None:
    retry = "update_slots : failed to find free space in the KV cache, retrying with smaller n_batch = 256"
    assert analyse(retry) == []  # the server decodes half the batch: slower, no failure
    (f,) = analyse(retry + "\nupdate_slots : failed to decode the batch, n_batch = 1, ret = 1")
    assert (f.engine, f.cls, f.knob, f.first_line) == ("llama.cpp", "unknown", "n_ctx", 1)
    assert "no device allocation failed" in (f.reason or "")


def test_vllm_profiling_line_and_its_raise_are_one_event() -> None:
    profile = ("INFO 02-26 09:54:05 worker.py:267] the current vLLM instance can use total_gpu_memory (8.00GiB) x "
               "gpu_memory_utilization (0.70) = 5.60GiB\n"
               "INFO 02-26 09:54:05 worker.py:267] model weights take 5.20GiB; non_torch_memory takes 0.03GiB; PyTorch "
               "activation peak memory takes 1.42GiB; the rest of the memory reserved for KV Cache is -1.05GiB.\n"
               "INFO 02-26 09:54:05 executor_base.py:111] # cuda blocks: 0, # CPU blocks: 4681\n")
    raise_line = ("ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                  "initializing the engine.")
    for text in (profile, profile + raise_line):
        (f,) = analyse(text)
        assert (f.engine, f.cls, f.rule) == ("vllm", "reservation_conflict", "vllm.kv.no-cache-blocks/fraction")


@pytest.mark.parametrize(("text", "rule"), [
    ("EL0004: [PID: 1000] 2025-09-28-07:22:29.827.496 Failed to allocate memory.\n"
     "        Failed to allocate resource[DeviceMemory] with info [size:2147483648]. Reason: Memory resources are "
     "exhausted.", "ascend.cann-alloc"),
    ("RuntimeError: [enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: not enough memory: you tried to "
     "allocate 34359738368 bytes.", "pytorch.cpu-allocator"),
    ("RuntimeError: CUDA driver error: out of memory", "gpu.cuda-runtime-oom"),
    ("ggml_vulkan: Device memory allocation of size 4294967296 failed.",
     "llama.cpp.cuda-buffer/vulkan-allocation-limit"),
    ("RuntimeError: Workspace can't be allocated, no enough memory.", "deepspeed.inference-workspace"),
    ("ggml_metal_graph_compute: command buffer 0 failed with status 5\n"
     "error: Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)", "ggml.metal-command-buffer"),
    ("Error: 500 Internal Server Error: memory layout cannot be allocated with num_gpu = 49", "ollama.layout"),
    ("llama_init_from_model: failed to initialize the context: failed to allocate compute pp buffers",
     "llama.cpp.compute-buffer"),
    ("jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 12.31GiB.",
     "xla.gpu.out-of-memory"),
    ("Failed to allocate memory for tensor(torch.Size([2, 80, 256, 256]), torch.float16) because no memory is "
     "available (memory_management.py:444:lmcache.experimental.memory_management)", "lmcache.buffer-full"),
])
def test_more_formats_are_recognised_and_left_unknown_without_sizes_to_compare(text: str, rule: str) -> None:
    (f,) = analyse(text)
    assert (f.cls, f.rule) == ("unknown", rule)
    assert f.reason and len(f.reason.split()) >= 8


def test_a_process_holding_the_device_outside_pytorch_is_not_fragmentation() -> None:
    # lmdeploy's TurboMind holds its weights and KV cache outside PyTorch; the vision encoder's PyTorch
    # allocation then fails with a little cached and a little free memory that only together cover it
    text = ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 132.00 MiB. GPU 0 has a total "
            "capacty of 21.99 GiB of which 123.00 MiB is free. Process 38517 has 21.86 GiB memory in use. Of the "
            "allocated memory 2.85 GiB is allocated by PyTorch, and 71.87 MiB is reserved by PyTorch but "
            "unallocated.")
    (f,) = analyse(text)
    assert f.cls == "reservation_conflict" and "outside PyTorch" in f.note
    # the same shortfall with the device held by PyTorch's own tensors stays the rubric's fragmentation
    own = text.replace("2.85 GiB is allocated by PyTorch", "21.00 GiB is allocated by PyTorch")
    (f,) = analyse(own)
    assert f.cls == "fragmentation"


def test_xla_direct_allocation_is_unknown_without_the_allocator_setting() -> None:
    (f,) = analyse("XlaRuntimeError: RESOURCE_EXHAUSTED: Failed to allocate request for 6.27GiB (6727663616B) on "
                   "device ordinal 0")
    assert (f.cls, f.rule) == ("unknown", "xla.gpu.out-of-memory/outside-pool")
    assert "XLA_PYTHON_CLIENT_ALLOCATOR=platform" in (f.reason or "")


@pytest.mark.parametrize("text", [
    "E0312 10:01:02.123 pool.cc:88] Error: could not grow the device pool: out of memory",
    "[ERROR] some_runtime: failed to allocate the scratch buffer: out of memory",
    "Fatal: insufficient memory to load the adapter",
])
def test_an_unknown_format_naming_a_memory_failure_is_still_recognised(text: str) -> None:
    (f,) = analyse(text)
    assert f.cls == "unknown" and f.reason


@pytest.mark.parametrize("text", [
    "INFO: no out of memory errors in the last 24 h",
    "the docs explain what to do when you run out of memory",
])
def test_the_generic_rule_needs_a_failure_word(text: str) -> None:
    assert analyse(text) == []


_REMAT = ("W external/xla/xla/hlo/transforms/simplifiers/hlo_rematerialization.cc:3183] Can't reduce memory use below "
          "{lim:.2f}GiB ({lim_b} bytes) by rematerialization; only reduced to {m:.2f}GiB ({m_b} bytes), down from "
          "{m:.2f}GiB ({m_b} bytes) originally\n"
          "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
          "{m_b} bytes.")


@pytest.mark.parametrize(("lim", "m", "cls", "case"), [
    (10.0, 40.0, "capacity", "beyond-device-after-remat"),  # 4x the limit: more than the device at any fraction >= 1/3
    (20.0, 30.0, "unknown", "over-remat-limit"),  # a full device or a higher fraction may hold 1.5x
    (0.0, 30.0, "unknown", ""),  # XLA's own miscalculation, no device size
])
def test_xla_rematerialisation_limit_decides_only_far_beyond_it(lim: float, m: float, cls: str, case: str) -> None:
    text = _REMAT.format(lim=lim, lim_b=int(lim * 2**30), m=m, m_b=int(m * 2**30))
    (f,) = analyse(text)
    assert (f.engine, f.cls) == ("xla", cls)
    assert f.rule == "xla.gpu.out-of-memory" + (f"/{case}" if case else "")
    if cls == "unknown":
        assert f.reason
    # the warning alone is no failure
    assert analyse(text.splitlines()[0]) == []


def test_cuda_runtime_oom_in_a_vllm_log_is_the_budget_and_bare_it_is_unknown() -> None:
    err = ("RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other "
           "API call, so the stacktrace below might be incorrect.")
    (bare,) = analyse(err)
    assert (bare.cls, bare.rule) == ("unknown", "gpu.cuda-runtime-oom") and bare.reason
    (f,) = analyse("\n".join(f"(VllmWorker rank=0 pid=7) ERROR 06-05 06:18:13 [multiproc_executor.py:470] {x}"
                             for x in err.splitlines()))
    assert (f.engine, f.cls, f.rule, f.knob) == (
        "vllm", "reservation_conflict", "gpu.cuda-runtime-oom/outside-vllm-budget", "gpu_memory_utilization")
    assert "--gpu-memory-utilization" in f.remedy
    (o,) = analyse("Error: llama runner process has terminated: CUDA error: out of memory")
    assert (o.engine, o.cls, o.knob) == ("ollama", "unknown", None)


def test_a_raw_cuda_oom_while_vllm_loads_weights_is_not_the_kv_budget() -> None:
    text = ("(EngineCore pid=7) ERROR 05-05 07:35:19 [core.py:1136]   File \"/x/vllm/model_executor/model_loader/"
            "default_loader.py\", line 269, in load_weights\n"
            "(EngineCore pid=7) ERROR 05-05 07:35:19 [core.py:1136] RuntimeError: CUDA driver error: out of memory")
    (f,) = analyse(text)
    assert (f.engine, f.cls, f.rule) == ("vllm", "unknown", "gpu.cuda-runtime-oom/vllm-loading-weights")
    assert "--tensor-parallel-size" in (f.reason or "")


@pytest.mark.parametrize(("text", "cls", "rule"), [
    ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space vmem.",
     "unknown", "xla.compile.exceeds-memory-space/on-chip-space"),
    ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 21.90G of "
     "7.48G hbm. Exceeded hbm capacity by 14.42G.", "capacity", "xla.compile.exceeds-memory-space"),
    ("Compilation failure: Aborting compilation early because it's unlikely to have enough memory. Requires 40.00G, "
     "has 15.48G available.", "capacity", "xla.compile.early-abort"),
    ("Compilation failure: Aborting compilation early because it's unlikely to have enough memory. Requires 3.47E, "
     "has 14.49G available.", "unknown", "xla.compile.early-abort/impossible-size"),
])
def test_xla_compile_time_failures_decide_only_for_hbm_and_possible_sizes(text: str, cls: str, rule: str) -> None:
    (f,) = analyse(text)
    assert (f.engine, f.cls, f.rule) == ("xla", cls, rule)
    assert f.cls != "unknown" or f.reason


def test_tgis_not_enough_memory_names_one_knob_in_either_form() -> None:
    """The router's NotEnoughMemory(N) prints as "Not enough memory to handle `max_total_tokens=N`"
    (Display) or "NotEnoughMemory(N)" (Debug, from main): one error, one knob."""
    (display,) = analyse("Error: Not enough memory to handle `max_total_tokens=32768`")
    (debug,) = analyse("Error: Backend(NotEnoughMemory(32768))")
    assert display.knob == debug.knob == "max-total-tokens"
    assert display.cls == debug.cls == "capacity"
    assert display.extra["total_tokens"] == debug.extra["total_tokens"] == 32768


def test_free_memory_above_the_devices_total_is_no_evidence() -> None:
    """No engine prints more free memory than its device has: such numbers (an edited or mixed-up paste)
    decide nothing, and the answer says so; rounding in the print is allowed."""
    text = ("ValueError: Free memory on device ({free}/79.15 GiB) on startup is less than desired GPU memory "
            "utilization (0.9, 71.24 GiB). Decrease GPU memory utilization or reduce GPU memory used by other "
            "processes.")
    (f,) = analyse(text.format(free="80.5"))
    assert (f.cls, f.rule) == ("unknown", "vllm.startup.free-below-utilization/free-over-total")
    assert "more than the device's total" in (f.reason or "")
    (g,) = analyse(text.format(free="30.5"))
    assert (g.cls, g.rule) == ("reservation_conflict", "vllm.startup.free-below-utilization")


def test_a_host_weight_buffer_is_unknown_without_the_machines_free_ram() -> None:
    (f,) = analyse("alloc_tensor_range: failed to allocate CPU buffer of size 437944320\n"
                   "llama_model_load: error loading model: unable to allocate CPU buffer")
    assert (f.cls, f.rule) == ("unknown", "llama.cpp.model-buffer/host-buffer")
    assert "free -g" in (f.reason or "") and "417.66 MiB" in (f.reason or "")


@pytest.mark.parametrize(("text", "cls", "rule"), [
    # llama.cpp sets no fraction: the device holds what -ngl and -c put there
    ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 46963.85 MiB on device 0: cudaMalloc failed: "
     "out of memory", "capacity", "llama.cpp.cuda-buffer"),
    ("ggml_vulkan: Device memory allocation of size 118497280 failed.\n"
     "ggml_vulkan: vk::Device::allocateMemory: ErrorOutOfDeviceMemory", "capacity", "llama.cpp.cuda-buffer"),
    ("ggml_backend_sycl_buffer_type_alloc_buffer: can't allocate 2147483648 Bytes of memory on device",
     "capacity", "llama.cpp.cuda-buffer"),
    # one Vulkan allocation of several GiB: the driver's per-allocation limit is as likely as the device
    ("Device memory allocation of size 17368219904 failed.", "unknown",
     "llama.cpp.cuda-buffer/vulkan-allocation-limit"),
    # ollama picked the layers from its own estimate; the compute buffer is sized after the rest
    ("Feb 21 01:41:02 host ollama[402]: ggml_backend_cuda_buffer_type_alloc_buffer: allocating 9000.00 MiB on "
     "device 0: cudaMalloc failed: out of memory", "unknown", "llama.cpp.cuda-buffer/estimate"),
    ("Error: llama runner process has terminated: cudaMalloc failed: out of memory\n"
     "ggml_gallocr_reserve_n: failed to allocate ROCm0 buffer of size 5274339328", "unknown",
     "llama.cpp.cuda-buffer/compute"),
    # TensorRT's workspace is its static reservation, in either direction
    ("[E] [TRT] C:\\source\\rtSafe\\safeRuntime.cpp (25) - Cuda Error in "
     "nvinfer1::internal::DefaultAllocator::allocate: 2 (out of memory)", "reservation_conflict",
     "tensorrt.cuda-error"),
    # vLLM's sleep mode shares the GPU with another workload; while loading weights the KV share is not taken yet
    ("cuda error: out of memory at /workspace/csrc/cumem_allocator.cpp:62", "reservation_conflict", "vllm.sleep.cumem"),
    ("  File \"/usr/lib/python3/dist-packages/vllm/model_executor/model_loader/default_loader.py\", line 269, in "
     "load_weights\nCUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:62", "unknown",
     "vllm.sleep.cumem/loading-weights"),
])
def test_an_engines_own_mechanism_commits_to_its_class(text: str, cls: str, rule: str) -> None:
    f = analyse(text)[0]  # the first event; a compute buffer's own line is a second one
    assert (f.cls, f.rule) == (cls, rule)
    if cls == "unknown":
        assert f.reason and len(f.reason.split()) >= 8
    else:
        assert f.knob and f.remedy


@pytest.mark.parametrize(("text", "cls", "rule"), [
    # older ggml's context buffer: one host malloc the size of the weights or the KV cache
    ("GGML_ASSERT: /home/ci/project/gpt4all-backend/llama.cpp-230511/ggml.c:4411: ctx->mem_buffer != NULL\nAborted",
     "capacity", "ggml.context-alloc/posix"),
    ("GGML_ASSERT: D:\\a\\llama.cpp\\ggml.c:4411: ctx->mem_buffer != NULL", "unknown", "ggml.context-alloc"),
    # node-llama-cpp's full KV cache: no device allocation failed
    ("[Error: could not find a KV slot for the batch (try reducing the size of the batch or increase the context)]",
     "unknown", "llama.cpp.kv-slots-full"),
    # the context creation cut to its last line: KV cache, compute buffer or a refused parameter
    ("Error: llama runner process has terminated: signal: aborted (core dumped) error:failed to create context with "
     "model '/var/lib/ollama/.ollama/models/blobs/sha256-e84e'", "unknown", "llama.cpp.context-create"),
])
def test_older_and_wrapped_ggml_formats_are_recognised(text: str, cls: str, rule: str) -> None:
    from infersight.hooks import _enginelog

    assert _enginelog.interesting(text)  # the hooks' prefilter passes it on
    (f,) = analyse(text)
    assert (f.cls, f.rule) == (cls, rule)
    assert f.engine in ("llama.cpp", "ollama")
    if cls == "unknown":
        assert f.reason and len(f.reason.split()) >= 8


@pytest.mark.parametrize(("text", "rule"), [
    # a ggml context's arena, sized by the program's own estimate: neither RAM nor VRAM ran out
    ("ggml_new_object: not enough space in the context's memory pool (needed 10882896, available 10650320)",
     "ggml.context-pool"),
    # node-llama-cpp refuses from its own estimate against the VRAM free at that moment
    ("Error: InsufficientMemoryError: A context size of 4096 with 4 sequences is too large for the available VRAM",
     "node-llama-cpp.insufficient-memory"),
    # early SGLang: the scheduler had admitted the batch, so the pool's bookkeeping disagrees
    ("Prefill out of memory. This should nerver happen.", "sglang.pool.out-of-tokens/admitted-batch"),
])
def test_engine_bookkeeping_and_estimates_are_recognised_and_left_unknown(text: str, rule: str) -> None:
    (f,) = analyse(text)
    assert (f.cls, f.rule) == ("unknown", rule)
    assert f.reason and len(f.reason.split()) >= 8


def test_ggml_context_pool_numbers_are_read() -> None:
    (f,) = analyse("ggml_new_object: not enough space in the context's memory pool (needed 10882896, available "
                   "10650320)")
    assert (f.extra["pool_needed_bytes"], f.extra["pool_size_bytes"]) == (10882896, 10650320)


_CONV = ('%cudnn-conv = (f32[1,112,112,64]{2,1,3,0}, u8[0]{0}) custom-call(f32[1,224,224,3]{2,1,3,0} %p0), '
         'custom_call_target="__cudnn$convForward"')
_CONV_HEADER = ("jaxlib.xla_extension.XlaRuntimeError: UNKNOWN: "
                "Failed to determine best cudnn convolution algorithm for:\n")
_ALL_TRIED = ("\n\nOriginal error: INTERNAL: All algorithms tried for " + _CONV + " failed. Falling back to default "
              "algorithm.  Per-algorithm errors:\n  Profiling failure on cuDNN engine eng34{k2=1}: UNKNOWN: {status}\n")


@pytest.mark.parametrize(("text", "rules"), [
    ("Failed to determine best cudnn convolution algorithm", ["xla.gpu.conv-autotune"]),
    # cuDNN's own memory outside the pool, or a cuDNN build that does not support the GPU: unknown
    (_CONV_HEADER + _CONV + _ALL_TRIED.replace("{status}", "CUDNN_STATUS_EXECUTION_FAILED"), ["xla.gpu.conv-autotune"]),
    (_CONV_HEADER + _CONV + _ALL_TRIED.replace("{status}", "<unknown cudnn status: 5003>"), ["xla.gpu.conv-autotune"]),
    # the pool's own memory error: one finding, XLA's memory rule's
    (_CONV_HEADER + _CONV + "\n\nOriginal error: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
     "1073741824 bytes.", ["xla.gpu.out-of-memory"]),
    (_CONV_HEADER + _CONV + _ALL_TRIED.replace("{status}", "Scratch allocation failed: RESOURCE_EXHAUSTED: Out of "
                                               "memory while trying to allocate 1073741824 bytes."),
     ["xla.gpu.out-of-memory"]),
    # no memory error: another status, TensorFlow's older warning (XLA went on), prose
    (_CONV_HEADER + _CONV + "\n\nOriginal error: UNIMPLEMENTED: DNN library does not support this convolution", []),
    ("W gpu_conv_algorithm_picker.cc:729] Failed to determine best cudnn convolution algorithm: Internal: All "
     "algorithms tried for convolution %cudnn-conv failed.  Falling back to default algorithm.", []),
    ("Failed to determine best cudnn convolution algorithm. Falling back to default. Performance may be sub optimal.",
     []),
    ("if you see `Failed to determine best cudnn convolution algorithm/No GPU/TPU found`, export "
     "XLA_PYTHON_CLIENT_PREALLOCATE=false", []),
])
def test_xla_conv_autotune_failure_is_unknown_only_without_a_deciding_status(text: str, rules: list[str]) -> None:
    found = analyse(text)
    assert [f.rule.split("/")[0] for f in found] == rules
    if rules == ["xla.gpu.conv-autotune"]:
        assert found[0].cls == "unknown" and "5003" in (found[0].reason or "")


def _triton_table(message: str, width: int = 100) -> str:
    """Triton's model status table: the status cell cut every ``width`` characters, mid-word as its printer cuts,
    onto rows whose other cells are empty (a message of one line; more lines go in as they are)."""
    if "\n" in message:
        return message
    pieces = [message[k:k + width] for k in range(0, len(message), width)]
    rows = ["| %-12s | %-7s | %-*s |" % ("my_model" if k == 0 else "", "1" if k == 0 else "", width, p)
            for k, p in enumerate(pieces)]
    rule = "+%s+%s+%s+" % ("-" * 14, "-" * 9, "-" * (width + 2))
    return "\n".join([rule, "| %-12s | %-7s | %-*s |" % ("Model", "Version", width, "Status"), rule, *rows, rule])


# How people paste a log: each line under a journald, docker-compose or markdown-quote prefix, in terminal colours,
# inside a JSON error body (json.dumps escapes the newlines and writes non-ASCII as \\uXXXX), in Triton's model
# status table, or as the container runtime's JSON log records.
PASTED_FORMS = {
    "journald": lambda m: "\n".join("Nov 25 06:44:10 gpu-host app[95]: " + line for line in m.split("\n")),
    "compose": lambda m: "\n".join("app-1  | " + line for line in m.split("\n")),
    "quoted": lambda m: "\n".join("> " + line for line in m.split("\n")),
    "colours": lambda m: "\n".join("\x1b[31m" + line + "\x1b[0m" for line in m.split("\n")),
    "json-body": lambda m: json.dumps({"error": {"message": m}}),
    "triton-table": _triton_table,
    "container-json": lambda m: "\n".join(json.dumps({"log": line + "\n", "stream": "stderr",
                                                      "time": "2026-11-30T10:00:00.000000001Z"})
                                           for line in m.split("\n")),
}


@pytest.mark.parametrize("form", sorted(PASTED_FORMS))
def test_a_message_keeps_its_verdict_however_it_was_pasted(form: str) -> None:
    """Every labelled memory error the rules find: the same rule and class under each pasted form (a pattern that
    spans lines is tried on the lines with their shared log prefix cut, colours are dropped, JSON unescaped, a wrapped
    table cell joined)."""
    records = [r for r in ALL_SETS if r["label"] != "not_oom"]
    changed = []
    for r in records:
        plain = analyse(r["message"])
        if not plain:
            continue
        pasted = analyse(PASTED_FORMS[form](r["message"]))
        want = (plain[0].rule.split("/")[0], plain[0].cls)
        if not pasted or (pasted[0].rule.split("/")[0], pasted[0].cls) != want:
            changed.append((r["id"], want, (pasted[0].rule, pasted[0].cls) if pasted else None))
    assert changed == []


@pytest.mark.parametrize("form", sorted(PASTED_FORMS))
def test_a_pytorch_message_keeps_its_verdict_however_it_was_pasted(form: str) -> None:
    """The PyTorch corpus (messages wrapped over lines by terminals and issue editors) under each pasted form; a
    journald header's host may hold a message word (gpu-host) and is still a log prefix."""
    changed = []
    for r in _load("oom_examples.jsonl"):
        plain, pasted = analyse(r["text"]), analyse(PASTED_FORMS[form](r["text"]))
        want = (plain[0].rule, plain[0].cls) if plain else None
        got = (pasted[0].rule, pasted[0].cls) if pasted else None
        if got != want:
            changed.append((r["id"], want, got))
    assert changed == []


def test_a_pattern_over_two_lines_matches_under_a_journald_prefix() -> None:
    text = """Aug 13 16:58:56 gpu-host llama-server[301]: CUDA error: out of memory
Aug 13 16:58:56 gpu-host llama-server[301]:   current device: 0, in function alloc at ggml/src/ggml-cuda.cu:420
Aug 13 16:58:56 gpu-host llama-server[301]:   ggml_cuda_device_malloc(&ptr, look_ahead_size, device)"""
    (f,) = analyse(text)
    assert f.rule == "ggml.cuda-error" and f.engine == "llama.cpp"
    # the lines as printed are tried first: a pattern that reads a prefix the lines share still matches
    trt = ("[TensorRT-LLM][ERROR] CUDA runtime error in ::cudaMalloc(ptr, n): out of memory\n"
           "[TensorRT-LLM][ERROR] 1 0x7f")
    assert analyse(trt)[0].rule.startswith("tensorrt-llm.cuda-runtime")


def test_triton_s_wrapped_status_cell_is_read_as_one_message() -> None:
    # Triton's model table cuts the status cell mid-word ("tllmB" / "uffers.h"), here under a docker-compose prefix
    text = """triton-1  | +----------------+---------+--------------------------------------------------------------+
triton-1  | | Model          | Version | Status                                                       |
triton-1  | +----------------+---------+--------------------------------------------------------------+
triton-1  | | tensorrt_llm   | 1       | UNAVAILABLE: Internal: [TensorRT-LLM][ERROR] CUDA runtime er |
triton-1  | |                |         | ror in ::cudaMallocAsync(ptr, n, mCudaStream->get()): out of |
triton-1  | |                |         |  memory (/app/tensorrt_llm/runtime/tllmBuffers.h:112)        |
triton-1  | +----------------+---------+--------------------------------------------------------------+"""
    (f,) = analyse(text)
    assert f.rule == "tensorrt-llm.cuda-runtime" and f.engine == "tensorrt-llm"
    # an ordinary table (no wrapped cell) is read as it is, and says nothing
    assert analyse("| GPU | Memory |\n| --- | --- |\n| A100 | 80 GiB |\n| L4 | 24 GiB |") == []


def test_a_log_shipped_as_json_records_is_read_by_its_messages() -> None:
    # TGI's --json-output (Rust tracing): the message sits under "fields"
    tgi = ('{"timestamp":"2026-11-30T10:00:00.000001Z","level":"ERROR","fields":{"message":"Server error: Not enough '
           'memory to handle 4096 prefill tokens. You need to decrease `--max-batch-prefill-tokens`"},'
           '"target":"text_generation_launcher"}')
    (f,) = analyse(tgi)
    assert f.rule.startswith("tgi.warmup.tokens")
    # journalctl -o json: MESSAGE, two records that make one ggml error
    journal = "\n".join(json.dumps({"_SYSTEMD_UNIT": "llama.service", "MESSAGE": m}) for m in (
        "CUDA error: out of memory", "  current device: 0, in function alloc at ggml/src/ggml-cuda.cu:420"))
    assert [x.rule for x in analyse(journal)] == ["ggml.cuda-error"]
    # a record without a message field, or a line that is no JSON, stays as it is
    assert analyse('{"level": "INFO", "tokens": 12}\n{"log": 5}\n{"oops') == []


def test_json_records_keep_an_error_held_in_another_field_and_odd_json_is_no_error() -> None:
    # python-json-logger puts the traceback in exc_info, beside the message
    record = json.dumps({"levelname": "ERROR", "message": "EngineCore failed to start.",
                         "exc_info": "Traceback (most recent call last):\ntorch.OutOfMemoryError: CUDA out of memory. "
                                     "Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which "
                                     "1.10 GiB is free."})
    assert [f.rule.split("/")[0] for f in analyse(record)] and analyse(record)[0].numbers["R"] == 2 * 1024 ** 3
    err = json.dumps({"msg": "request failed", "err": "RuntimeError: CUDA error: out of memory"})
    assert [f.rule for f in analyse(err)] == ["gpu.cuda-runtime-oom"]
    assert analyse('{"a":' * 1000 + "1" + "}" * 1000) == []  # nested past the parser's depth: no error


def test_a_wrapped_table_joins_a_bounded_text_and_a_log_kept_in_a_table_stays_readable() -> None:
    rows = ["|   | INFO 01-01 10:00:%02d step %d took 0.1s |" % (k % 60, k) for k in range(300)]
    rows.append("|   | ValueError: Free memory on device (1.5/79.2 GiB) on startup is less than desired GPU memory "
                "utilization (0.9, 71.3 GiB). |")
    (f,) = analyse("| time | log |\n" + "\n".join(rows))
    assert f.rule == "vllm.startup.free-below-utilization"
    # one head row and many continuation rows: linear (the pieces are joined once)
    many = "| a | b |\n" + "\n".join("|   | x%d |" % k for k in range(20000))
    assert analyse(many) == []


_CUDNN = ("E0101 10:00:00.000000   1234 cuda_dnn.cc:535] Could not create cudnn handle: {status}\n"
          "E0101 10:00:00.000000   1234 cuda_dnn.cc:539] Memory usage: {free} bytes free, 16928342016 bytes total.")


@pytest.mark.parametrize(("before", "status", "free", "after", "want"), [
    ("", "CUDNN_STATUS_INTERNAL_ERROR", 65536000, "", ("reservation_conflict", "xla.cudnn-handle/device-held")),
    # the ALLOC_FAILED status is cuDNN's own word for it: one finding, not a second from the cuBLAS/cuDNN rule
    ("", "CUDNN_STATUS_ALLOC_FAILED", 65536000, "", ("reservation_conflict", "xla.cudnn-handle/device-held")),
    ("I0101 10:00:00.000000   1234 se_gpu_pjrt_client.cc:900] XLA backend allocating 15235478528 bytes on device 0 "
     "for BFCAllocator.\n", "CUDNN_STATUS_INTERNAL_ERROR", 65536000, "",
     ("reservation_conflict", "xla.cudnn-handle/pool-took-device")),
    ("", "CUDNN_STATUS_NOT_INITIALIZED", 65536000,
     "\nE0101 10:00:00.000000   1234 cuda_dnn.cc:543] Possibly insufficient driver version: 470.57.2",
     ("unknown", "xla.cudnn-handle/driver")),
    # most of the device free: a cuDNN that does not match, no memory error (ALLOC_FAILED keeps its own rule)
    ("", "CUDNN_STATUS_INTERNAL_ERROR", 16154099712, "", None),
    ("", "CUDNN_STATUS_ALLOC_FAILED", 16154099712, "", ("reservation_conflict", "cublas.alloc-failed")),
])
def test_xlas_cudnn_handle_failure_is_read_with_the_memory_it_logs(before: str, status: str, free: int, after: str,
                                                                   want: tuple[str, str] | None) -> None:
    found = analyse(before + _CUDNN.format(status=status, free=free) + after)
    assert [(f.cls, f.rule) for f in found] == ([want] if want else [])
    if want and want[1].endswith("pool-took-device"):
        assert found[0].extra["reserved_bytes"] == 15235478528
        assert found[0].note.startswith("XLA's pool took 14.19 GiB (90% of the 15.77 GiB device)")


def test_sglangs_balance_check_is_unknown_when_raised_and_quiet_when_only_logged() -> None:
    head = "The memory capacity is unbalanced. Some GPUs may be occupied by other processes. "
    nums = "pre_model_load_memory=70.51234567890123, local_gpu_memory=78.9, local_gpu_memory * 0.9=71.01"
    (f,) = analyse("RuntimeError: " + head + nums)
    assert (f.cls, f.rule, f.knob) == ("unknown", "sglang.memory-unbalanced", "mem-fraction-static")
    assert f.extra == {"min_gpu_bytes": round(70.512345 * 2**30), "local_gpu_bytes": round(78.9 * 2**30)}
    assert "GPUs of different sizes" in (f.reason or "")
    (old,) = analyse("ValueError: " + head + "min_per_gpu_memory=20.5, local_gpu_memory=78.9, "
                     "local_gpu_memory * 0.9=71.01")
    assert old.extra["min_gpu_bytes"] == 20.5 * 2**30
    assert [g.rule for g in analyse(head.strip())] == ["sglang.memory-unbalanced"]  # quoted alone (a title)
    assert analyse("[2026-01-01 10:00:00 TP1] " + head + nums) == []  # SGLang's warning: it goes on starting


def test_vllm_v0_drops_a_prompt_its_whole_kv_cache_cannot_admit() -> None:
    (f,) = analyse("WARNING 05-01 10:00:00 scheduler.py:1089] Input prompt (40000 tokens) + lookahead slots (0) is too "
                   "long and exceeds the capacity of block_manager")
    assert (f.engine, f.cls, f.rule, f.extra) == ("vllm", "unknown", "vllm.v0.prompt-exceeds-cache",
                                                   {"prompt_tokens": 40000.0})
    assert "# GPU blocks" in (f.reason or "")


def test_a_message_repeated_with_another_timestamp_is_one_message() -> None:
    """'At most once per distinct message': a rule whose match takes in the log prefix (the generic one
    starts at the level word) keys the text with digit runs masked, so the same failure logged again a
    second later is the same message; the numbers a rule reads still tell two apart."""
    a = "ERROR 05-01 10:00:00 [engine.py:160] Error in model execution: insufficient memory"
    b = "ERROR 05-01 10:00:07 [engine.py:160] Error in model execution: insufficient memory"
    (fa,), (fb,) = analyse(a), analyse(b)
    assert fa.rule == "memory.generic" and fa.key == fb.key
    assert len(analyse(a + "\n" + b)) == 1
    small = ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 1024.00 MiB on device 0: cudaMalloc failed: "
             "out of memory")
    (fs,), (fl,) = analyse(small), analyse(small.replace("1024.00", "4096.00"))
    assert fs.key != fl.key


def test_the_needle_index_picks_every_rule_an_anchor_could_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """``analyse`` tries on a line only the rules one of whose anchors holds a needle the line holds: on every
    example of every rule and not_memory entry, the findings are the same as with every rule tried."""
    rs = serving.builtin()
    texts = [e.text for r in rs.rules for e in r.examples] + [e.text for q in rs.not_memory for e in q.examples]

    def found() -> list[list[tuple[str, str, str]]]:
        return [[(f.rule, f.cls, f.key) for f in serving.analyse(t, rs)] for t in texts]

    indexed = found()
    monkeypatch.setattr(serving.ServingRules, "rules_for", lambda self, line: self.rules)
    assert indexed == found()
    assert sum(map(len, indexed)) > 200  # the examples do find things


def test_a_device_ordinal_keeps_two_messages_apart() -> None:
    """Masking a log prefix's timestamps must not mask the device: eight llama.cpp servers failing on eight
    devices print the same words but for 'current device: N', and are eight messages."""
    keys = {analyse("CUDA error: out of memory\n  current device: %d, in function ggml_cuda_pool_malloc_vmm at "
                    "ggml-cuda.cu:8583" % n)[0].key for n in range(8)}
    assert len(keys) == 8


# A PyTorch OOM in a Ray Serve replica, as Ray's worker log prefix prints it (format of
# ray/_private/log.py's "(ServeReplica:app:Deployment pid=N)"); the sizes chosen for the case.
_RAY_SERVE_OOM = (
    "(ServeReplica:default:LLM pid=4242) ERROR 2026-12-04 08:00:00,000 default_LLM replica.py:1012 - "
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
    "79.15 GiB of which 1.12 GiB is free. Process 4242 has 38.10 GiB memory in use. Process 4343 has 39.90 GiB "
    "memory in use. Of the allocated memory 37.50 GiB is allocated by PyTorch, and 120.00 MiB is reserved by "
    "PyTorch but unallocated.")


def test_a_pytorch_oom_in_a_ray_serve_replica_names_rays_knobs() -> None:
    (f,) = analyse(_RAY_SERVE_OOM)
    assert (f.engine, f.cls) == ("ray", "reservation_conflict")  # another replica holds 39.90 GiB
    assert "num_gpus" in f.remedy and "In Ray Serve:" in f.remedy
    # vLLM's Ray executor prints Ray's prefixes too: the engine is still vLLM, with its own knobs
    (v,) = analyse("(RayWorkerWrapper pid=77) ray::RayWorkerWrapper.execute_method() vllm/worker/worker.py:190 "
                   + _RAY_SERVE_OOM.split(" - ", 1)[1])
    assert v.engine == "vllm" and "In vLLM:" in v.remedy


def test_rays_memory_monitor_kill_is_host_memory_in_gib() -> None:
    text = ("ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.\n"
            "Memory on the node (IP: 10.0.0.7, ID: ab12) where the task (task ID: cd34, name=LLM.__init__, pid=9, "
            "memory used=12.00GB) was running was 30.50GB / 32.00GB (0.953125), which exceeds the memory usage "
            "threshold of 0.95. Ray killed this worker (ID: ef56) because it was the most recently scheduled task")
    (f,) = analyse(text)
    assert (f.engine, f.rule, f.cls, f.knob) == ("ray", "ray.memory-monitor", "unknown", "RAY_memory_usage_threshold")
    assert f.numbers["T"] == 32 << 30 and f.numbers["U"] == 12 << 30  # Ray's "GB" are GiB
    assert f.extra["used_bytes"] == round(30.5 * (1 << 30)) and f.extra["fraction"] == 0.95
    assert f.reason and "Top 10 memory users" in f.reason
    # the same node with the killed task alone over 0.95 of it: no neighbour could have made room
    (g,) = analyse(text.replace("memory used=12.00GB", "memory used=30.40GB"))
    assert (g.cls, g.rule) == ("capacity", "ray.memory-monitor/task-beyond-threshold")


def test_an_engine_error_right_before_a_pytorch_message_is_its_own_event() -> None:
    """Two engines' errors on adjacent lines (a docker compose log of a shared GPU): both are found, in order."""
    text = ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 16384.00 MiB on device 0: cudaMalloc failed: "
            "out of memory\n"
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity of "
            "23.69 GiB of which 301.94 MiB is free. Including non-PyTorch memory, this process has 23.38 GiB memory "
            "in use. Of the allocated memory 22.91 GiB is allocated by PyTorch, and 164.26 MiB is reserved by PyTorch "
            "but unallocated.")
    found = analyse(text)
    assert [(f.engine, f.first_line) for f in found] == [("llama.cpp", 0), ("pytorch", 1)]


def test_the_device_total_an_engine_prints_fills_the_numbers_total() -> None:
    """vLLM's profile line says the device total (``total_gpu_memory=23.68GiB``): it is T of the numbers object,
    not only an engine key (a README walkthrough found ``T=-`` beside ``total_gpu_bytes=23.68 GiB``)."""
    text = ("INFO 11-18 09:12:05 worker.py:232] Memory profiling results: total_gpu_memory=23.68GiB "
            "initial_memory_usage=15.55GiB peak_torch_memory=16.24GiB memory_usage_post_profile=15.63GiB "
            "non_torch_memory=0.63GiB kv_cache_size=4.44GiB gpu_memory_utilization=0.90\n"
            "ERROR 11-18 09:12:05 engine.py:366] No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine.\n")
    (f,) = analyse(text, builtin())
    assert f.engine == "vllm" and f.extra["total_gpu_bytes"] == parse_bytes("23.68GiB")
    assert f.numbers["T"] == round(parse_bytes("23.68GiB"))


# -- long texts (review findings) -------------------------------------------------------------------------


LLAMA_LINE = ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 1024.00 MiB on device 0: cudaMalloc failed: "
              "out of memory")
VLLM_LEN_LINE = ("ValueError: The model's max seq len (32768) is larger than the maximum number of tokens that can be "
                 "stored in KV cache (20000). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` "
                 "when initializing the engine.")


@pytest.mark.parametrize("line", [LLAMA_LINE, VLLM_LEN_LINE])
@pytest.mark.parametrize("before", [10, serving.WINDOW_CHARS + 100, 20_000])
def test_an_error_past_the_first_window_of_a_long_line_reads_the_same(line: str, before: int) -> None:
    """A rule reads a line's first window: an error at the end of a long line (a config dump before it)
    was missed or read without its numbers (a confident class from none)."""
    short = serving.analyse(line)
    (f,) = serving.analyse("W" * before + " " + line)
    assert (f.rule, f.cls, f.numbers) == (short[0].rule, short[0].cls, short[0].numbers)


def test_a_long_line_keeps_what_lies_around_its_first_and_last_needles() -> None:
    line = '{"gpu_memory_utilization": 0.9, ' + '"x": 1, ' * 3000 + '"note": "memory"} ' + LLAMA_LINE
    focused = serving._focused(line)
    assert len(focused) <= serving.WINDOW_CHARS
    assert focused.startswith('{"gpu_memory_utilization"') and focused.endswith(LLAMA_LINE)
    (f,) = serving.analyse(line)
    assert f.rule == "llama.cpp.cuda-buffer" and f.numbers["R"] == 1 << 30


def test_a_message_repeated_past_the_findings_bound_leaves_room_for_the_next_error() -> None:
    """A scheduler's line logged every step counts once toward MAX_FINDINGS: an error after 600 repeats of
    another was not read (``classify`` on a log and the live path disagreed)."""
    repeated = "".join("ERROR 06:33:%02d,%03d [scheduler.py:100] Not enough memory. Please try to increase "
                       "--mem-fraction-static.\n" % (i // 1000, i % 1000) for i in range(600))
    found = serving.analyse(repeated + LLAMA_LINE + "\n")
    assert [f.rule for f in found] == ["sglang.pool.not-enough", "llama.cpp.cuda-buffer"]


def test_a_pytorch_message_wrapped_after_its_exception_name_is_one_finding() -> None:
    """A terminal or a collector that wraps "torch.OutOfMemoryError: CUDA out of" / "memory. Tried ..." left a bare
    "out of memory" line before the message: it was a second finding, ``unknown`` (gpu.bare-oom), before the
    real verdict (a review: the corpus's oom-185 wrapped at 79 columns)."""
    text = ("torch.OutOfMemoryError: CUDA out of\nmemory. Tried to allocate 1024.00 MiB. GPU 0 has a total capacity "
            "of 79.15 GiB of which 512.00 MiB is free.")
    found = analyse(text)
    assert [f.key.split("|")[0] for f in found] == ["pytorch"], [f.rule for f in found]
    assert found[0].first_line == 0
    unwrapped = analyse("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1024.00 MiB.\nsomething else")
    assert len(unwrapped) == 1 and unwrapped[0].first_line == 0


def test_an_engine_with_most_of_its_device_free_keeps_the_rubrics_fragmentation() -> None:
    """The "an engine's pools fill the device" reading needs a device they could have filled: a vLLM worker's OOM
    with 8.20 of 10.76 GiB free came out ``capacity`` ("a full device"), with a note that C + F' missed R by a
    negative amount (a review). The same message without the prefix is fragmentation, and now with it too."""
    msg = ("RuntimeError: CUDA out of memory. Tried to allocate 8.13 GiB (GPU 0; 10.76 GiB total capacity; "
           "643.57 MiB already allocated; 8.20 GiB free; 32.43 MiB cached)")
    plain = analyse(msg)[0]
    prefixed = analyse("(VllmWorker rank=0 pid=1234) ERROR 11-20 10:01:00 [multiproc_executor.py:487] " + msg)[0]
    assert plain.cls == prefixed.cls == "fragmentation"
    assert prefixed.engine == "vllm"
    assert "misses R by only -" not in (prefixed.note or "") + (plain.note or "")
