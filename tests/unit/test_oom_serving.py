"""Serving-engine memory errors (issue 24): recognised, classified in the engine's terms,
``unknown`` with a reason when the text does not decide, no false alarms.

The data is vendored: ``tests/support/data/serving_ooms_given.jsonl`` (30 labelled messages with
their threads), ``serving_ooms_collected.jsonl`` (more from other public threads, real
non-memory errors of the same engines among them, each with its source) and
``serving_ooms_unseen.jsonl`` (a second collection, labelled before the rules it measures
were changed; records whose thread a rule example quotes are marked ``in_rule_examples``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from infersight.agent.commands.classify import main
from infersight.rules.serving import (
    ENGINES,
    ServingRulesError,
    analyse,
    builtin,
    builtin_serving_path,
    detect_engine,
    load_serving_rules,
    size_bytes,
)
from infersight.rules.serving_measure import score

DATA = Path(__file__).resolve().parents[1] / "support" / "data"


def _load(name: str) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(x) for x in (DATA / name).read_text(encoding="utf-8").splitlines() if x.strip()]


GIVEN = _load("serving_ooms_given.jsonl")
COLLECTED = _load("serving_ooms_collected.jsonl")
UNSEEN = _load("serving_ooms_unseen.jsonl")


def test_the_data_is_vendored_with_sources() -> None:
    assert len(GIVEN) == 30
    for r in GIVEN + COLLECTED + UNSEEN:
        assert r["url"].startswith("https://github.com/"), r["id"]
    for r in GIVEN + UNSEEN:
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
    assert s.clear_right / s.clear >= 0.75, s.misses
    for cls, (right, n) in s.per_class.items():
        assert n == 0 or right / n >= 0.5, (cls, s.misses)


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


def test_floors_on_the_unseen_messages() -> None:
    s = score([r for r in UNSEEN if not r["in_rule_examples"]])
    assert s.recognised == s.memory_errors, s.misses
    assert s.false_alarms == 0, s.misses
    assert s.unclear_unknown >= s.unclear / 2, s.misses


_MAX_LEN = ("ValueError: The model's max seq len ({n}) is larger than the maximum number of tokens that can be "
            "stored in KV cache ({kv}). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when "
            "initializing the engine.")


@pytest.mark.parametrize(("prefix", "n", "kv", "cls", "case"), [
    ("", 8192, 7900, "reservation_conflict", "within-fraction-headroom"),
    ("", 8192, 6500, "unknown", "gap-undecided"),
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
        assert "gpu_memory_utilization" in (f.reason or "")


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


def test_engine_comes_from_the_log_around_a_pytorch_message() -> None:
    found = analyse(next(r["message"] for r in GIVEN if r["id"] == "srv-028"))
    assert [f.engine for f in found] == ["vllm", "vllm"]  # two NPUs, two messages
    assert all("In vLLM:" in f.remedy for f in found)
    assert detect_engine("Jan 26 ollama[1418]: ggml_backend_cuda_buffer_type_alloc_buffer") == "ollama"


def test_size_units() -> None:
    assert size_bytes("15.65G") == round(15.65 * (1 << 30))
    assert size_bytes("939524096") == 939524096
    assert size_bytes("0.49", "GiB") == round(0.49 * (1 << 30))
    assert size_bytes("lots") is None


def test_invalid_rule_file_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('engine_version = "1.0"\n\n[[rule]]\nid = "x.y"\nversion = 1\nengine = "vllm"\n'
                   'anchors = ["out of memory"]\npatterns = [\'\'\'(a+)+\'\'\']\nmechanism = "too short"\n'
                   'class = "unknown"\nremedy = "r"\n', encoding="utf-8")
    with pytest.raises(ServingRulesError) as exc:
        load_serving_rules([bad])
    text = str(exc.value)
    assert f"{bad}:8:" in text and "backtracking" in text
    assert "mechanism" in text and "reason" in text and "positive and one negative" not in text


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
