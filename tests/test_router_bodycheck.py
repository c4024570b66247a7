"""Hostile JSON found before parsing recursion or re-encoding
(bidirkv/router/request/bodycheck.py)."""

import json

from bidirkv.router.request import bodycheck
from bidirkv.router.request.bodycheck import (
    MAX_DEPTH,
    depth_problem,
    nesting_problem,
    surrogate_problem,
)


def nested(depth: int, inner: str = "1") -> bytes:
    return ("[" * depth + inner + "]" * depth).encode()


def test_depth_limit_is_exact():
    assert nesting_problem(nested(MAX_DEPTH)) is None
    assert "deeper than 64" in nesting_problem(nested(MAX_DEPTH + 1))
    mixed = ('{"a":' * 40 + "[" * 30 + "0" + "]" * 30 + "}" * 40).encode()
    assert nesting_problem(mixed) is not None


def test_the_parsed_depth_limit_is_exact_through_objects_and_arrays():
    for depth in (1, MAX_DEPTH):
        assert depth_problem(json.loads(nested(depth))) is None
    assert "deeper than 64" in depth_problem(json.loads(nested(MAX_DEPTH + 1)))
    mixed = json.loads('{"a":' * 40 + "[" * 25 + "0" + "]" * 25 + "}" * 40)
    assert depth_problem(mixed) is not None
    assert depth_problem(json.loads('{"a":' * 40 + "[" * 24 + "0" + "]" * 24 + "}" * 40)) \
        is None
    # The deep branch beside many shallow ones; scalars and wide bodies pass.
    wide = {"messages": [{"role": "user", "content": "x"}] * 500, "deep": mixed}
    assert depth_problem(wide) is not None
    assert depth_problem({**wide, "deep": []}) is None
    assert depth_problem("text") is None and depth_problem([[], {}]) is None


def test_brackets_inside_strings_do_not_count():
    body = json.dumps({"messages": [{"role": "user", "content": "[" * 5000 + '\\"{'}]})
    assert nesting_problem(body.encode()) is None


def test_wide_bodies_pass_and_unbalanced_ones_are_left_to_the_parser():
    wide = ("[" + ",".join(["[[1],{}]"] * 20000) + "]").encode()
    assert nesting_problem(wide) is None
    assert nesting_problem(b"]" * 100 + b"[" * 100) is None  # invalid JSON: the parser's


def test_a_huge_deep_body_is_refused_after_max_depth_brackets(monkeypatch):
    """Work, not seconds: however deep the body, the scan stops at the first bracket past
    MAX_DEPTH (a time bound would hold on one CPU and fail on a slower one)."""
    seen, real = [], bodycheck._TOKEN

    class CountingPattern:
        def finditer(self, data):
            for m in real.finditer(data):
                seen.append(m.start())
                yield m

    monkeypatch.setattr(bodycheck, "_TOKEN", CountingPattern())
    assert nesting_problem(nested(2_000_000)) is not None
    assert len(seen) == MAX_DEPTH + 1
    # A wide body: one step per bracket, in one pass.
    seen.clear()
    wide = ("[" + ",".join(["[[1],{}]"] * 1000) + "]").encode()
    assert nesting_problem(wide) is None
    assert len(seen) == wide.count(b"[") + wide.count(b"]") + wide.count(b"{") * 2


def test_lone_surrogates_are_found_with_their_path():
    raw = b'{"messages":[{"role":"user","content":"a\\ud800b"}]}'
    assert surrogate_problem(raw).startswith("messages[0].content:")
    pair = b'{"messages":[{"role":"user","content":"\\ud83d\\ude00"}]}'
    assert surrogate_problem(pair) is None
    key = b'{"\\udfff":1}'
    assert surrogate_problem(key).startswith("<key>")
