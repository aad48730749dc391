"""Two copies of one engine message: the same rule and text, one copy's numbers among the other's."""

from __future__ import annotations

from infersight.agent.oom.kind import same_message


def test_a_copy_with_fewer_numbers_is_the_same_message() -> None:
    head = "ray.memory-monitor|Task was killed due to the node running low on memory|"
    full = head + "T=2.5e+10,U=5.4e+07,used_bytes=1.8e+09"
    cut = head + "T=2.5e+10,used_bytes=1.8e+09"
    assert same_message(full, cut) and same_message(cut, full)


def test_different_numbers_or_texts_or_rules_are_different_messages() -> None:
    a = "ray.memory-monitor|Task was killed due to the node running low on memory|T=2.5e+10,used_bytes=1.8e+09"
    assert not same_message(a, a.replace("used_bytes=1.8e+09", "used_bytes=2.1e+09"))  # another kill
    assert not same_message(a, a.replace("Task was", "1 worker(s) were"))
    assert not same_message(a, a.replace("ray.memory-monitor", "vllm.kv.no-cache-blocks"))
    # a key that is no serving rule's (a PyTorch message's): exact only
    assert not same_message("CUDA out of memory, a, b", "CUDA out of memory, a")
