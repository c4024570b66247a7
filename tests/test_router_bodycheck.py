"""Hostile JSON found before parsing recursion or re-encoding (router/bodycheck.py)."""

import json

from bidirkv.router import bodycheck
from bidirkv.router.bodycheck import MAX_DEPTH, nesting_problem, surrogate_problem


def nested(depth: int, inner: str = "1") -> bytes:
    return ("[" * depth + inner + "]" * depth).encode()


def test_depth_limit_is_exact():
    assert nesting_problem(nested(MAX_DEPTH)) is None
    assert "deeper than 64" in nesting_problem(nested(MAX_DEPTH + 1))
    mixed = ('{"a":' * 40 + "[" * 30 + "0" + "]" * 30 + "}" * 40).encode()
    assert nesting_problem(mixed) is not None


def test_brackets_inside_strings_do_not_count():
    body = json.dumps({"messages": [{"role": "user", "content": "[" * 5000 + '\\"{'}]})
    assert nesting_problem(body.encode()) is None


def test_wide_bodies_pass_and_unbalanced_ones_are_left_to_the_parser():
    wide = ("[" + ",".join(["[[1],{}]"] * 20000) + "]").encode()
    assert nesting_problem(wide) is None
    assert nesting_problem(b"[" * 100) is None  # no closing brackets: invalid JSON


def test_a_huge_deep_body_is_refused_in_a_bounded_number_of_passes(monkeypatch):
    """Work, not seconds: no recursion, and at most MAX_DEPTH linear passes over the body,
    however deep it is (a time bound would hold on one CPU and fail on a slower one)."""
    passes, real = [], bodycheck._PAIR

    class CountingPattern:
        def sub(self, repl, data):
            passes.append(len(data))
            return real.sub(repl, data)

    monkeypatch.setattr(bodycheck, "_PAIR", CountingPattern())
    body = nested(2_000_000)
    assert nesting_problem(body) is not None
    assert len(passes) == MAX_DEPTH and max(passes) <= len(body)


def test_lone_surrogates_are_found_with_their_path():
    raw = b'{"messages":[{"role":"user","content":"a\\ud800b"}]}'
    assert surrogate_problem(raw).startswith("messages[0].content:")
    pair = b'{"messages":[{"role":"user","content":"\\ud83d\\ude00"}]}'
    assert surrogate_problem(pair) is None
    key = b'{"\\udfff":1}'
    assert surrogate_problem(key).startswith("<key>")
