"""Decode's /bidirkv/residency body: what is refused, and ids it skips (pure)."""

import pytest

from bidirkv.connector.endpoint import MAX_ID, body_problem, valid_ids


def test_a_batch_with_bad_ids_is_taken_and_the_bad_ones_skipped():
    body = {"owner": "r", "leaseSeconds": 15,
            "release": ["chatcmpl-a-1", "x" * (MAX_ID + 1), "", 7, None, "chatcmpl-b-2"]}
    assert body_problem(body) is None
    assert valid_ids(body["release"]) == (["chatcmpl-a-1", "chatcmpl-b-2"], 4)


@pytest.mark.parametrize("body, word", [
    ([], "JSON object"), ({"owner": "r"}, "go together"), ({"nope": 1}, "unknown keys"),
    ({"release": "a"}, "list"), ({"owner": "r", "leaseSeconds": 0}, "1-86400"),
])
def test_what_is_still_refused(body, word):
    assert word in body_problem(body)
