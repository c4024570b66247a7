"""Where the local stack's router runs: the cores decode's engines leave (local/cpuset.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bidirkv.local.cpuset import CpuChoice, choose_cores, format_cores, pinned_thread

ALL2 = frozenset({0, 1})
ALL16 = frozenset(range(16))


@pytest.mark.parametrize(("binds", "available", "cores", "decode"), [
    ({"decode-0": "1"}, ALL2, {0}, {1}),
    ({"decode-0": "0"}, ALL2, {1}, {0}),
    ({"decode-0": "0,2"}, frozenset(range(4)), {1, 3}, {0, 2}),
    ({"decode-0": "0-3|4-7"}, ALL16, set(range(8, 16)), set(range(8))),
    ({"decode-0": " 2-3 "}, frozenset(range(4)), {0, 1}, {2, 3}),
    ({"decode-0": "1", "decode-1": "2"}, frozenset(range(4)), {0, 3}, {1, 2}),
    # Only the cores it may use count: a taskset around `local up` narrows the choice.
    ({"decode-0": "1"}, frozenset({1, 2, 3}), {2, 3}, {1}),
])
def test_the_router_gets_what_decode_leaves(binds, available, cores, decode):
    choice = choose_cores(binds, available)
    assert choice.cores == frozenset(cores)
    assert choice.decode == frozenset(decode)


@pytest.mark.parametrize(("binds", "available", "said"), [
    ({"decode-0": "auto"}, ALL2, "decode-0's VLLM_CPU_OMP_THREADS_BIND is 'auto': vLLM picks"),
    ({"decode-0": "nobind"}, ALL2, "is 'nobind': its threads are not bound"),
    ({"decode-0": "all"}, ALL2, "is 'all': every core"),
    ({"decode-0": None}, ALL2, "decode-0's VLLM_CPU_OMP_THREADS_BIND is not set"),
    # One engine left to vLLM is enough not to know.
    ({"decode-0": "1", "decode-1": "auto"}, frozenset(range(4)), "decode-1's"),
    ({"decode-0": "1-x"}, ALL2, "'1-x' is not a core list (e.g. '1', '0-3'"),
    ({"decode-0": "0-1"}, ALL2, "decode binds 0-1, every core it may use (0-1)"),
    ({"decode-0": "1", "decode-1": "0"}, ALL2, "decode binds 0-1, every core"),
    ({"decode-0": "5"}, ALL2, "decode binds 5, none of the cores it may use (0-1)"),
    ({}, ALL2, "no decode engine"),
    ({"decode-0": "1"}, None, "the cores this machine lets it use are unknown"),
])
def test_nothing_is_pinned_where_the_cores_cannot_be_known_or_none_is_left(
        binds, available, said):
    choice = choose_cores(binds, available)
    assert choice.cores is None
    assert said in choice.why
    assert choice.line().startswith("router not pinned: ")


def test_the_line_names_both_sets():
    assert choose_cores({"decode-0": "1"}, ALL2).line() == "router on cores 0 (decode binds 1)"
    assert CpuChoice(frozenset({0, 1, 2, 5}), frozenset({3, 4})).line("x") == \
        "x on cores 0-2,5 (decode binds 3-4)"


@pytest.mark.parametrize(("cores", "text"), [
    ([], ""), ([3], "3"), ([2, 0, 1], "0-2"), ([0, 2, 4], "0,2,4"),
    ([0, 1, 5, 6, 7, 9], "0-1,5-7,9"),
])
def test_format_cores(cores, text):
    assert format_cores(cores) == text


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity")
def test_a_process_started_inside_pinned_thread_runs_on_those_cores_and_the_thread_is_restored():
    before = os.sched_getaffinity(0)
    one = frozenset({min(before)})
    code = "import os; print(sorted(os.sched_getaffinity(0)))"
    with pinned_thread(one):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout
    assert out.strip() == str(sorted(one))
    assert os.sched_getaffinity(0) == before
    with pinned_thread(None):
        assert os.sched_getaffinity(0) == before
