"""Decode's notes beside retained requests (connector/core/notes.py): kept only for what
the caller holds, bounded, dropped when the request leaves, recalled by pages."""

from types import SimpleNamespace

import pytest

from bidirkv.connector.core import residency as core
from bidirkv.connector.core.notes import MAX_NOTE, Notes, exchange
from bidirkv.connector.core.residency import Residency
from bidirkv.connector.endpoint import MAX_ID, body_problem, valid_notes
from bidirkv.connector.patches.residency import residency_utility


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def held(owner: str = "r1", n: int = 3, **kw) -> tuple[Residency, Clock]:
    clock = Clock()
    res = Residency(clock=clock, **kw)
    for i in range(n):
        res.retain(f"q{i}", 2, owner, clock.t + 100)
    return res, clock


def keep(res: Residency, owner: str, notes: dict[str, str], recall: int | None = None):
    return exchange(res.notes, res.lock, res.holds, owner, notes, recall)


def test_a_note_is_kept_only_beside_a_request_its_owner_holds():
    res, _ = held()
    res.retain("theirs", 1, "r2", 1e9)
    res.grant("q2")
    out = keep(res, "r1", {"q0": "a", "theirs": "b", "q2": "c", "nope": "d"})
    assert out["notesKept"] == 1 and out["notesRefused"] == {"not_held": 3}
    assert keep(res, "r1", {}, 0)["notes"] == {"q0": "a"}
    assert keep(res, "r2", {}, 0)["notes"] == {}


@pytest.mark.parametrize("leave", [
    lambda res, clock: res.release(["q0"]),
    lambda res, clock: res.grant("q0"),
    lambda res, clock: res.frees(["q0"]),
    lambda res, clock: res.reclaim(100),
    lambda res, clock: (setattr(clock, "t", clock.t + 60), res.expire_owners()),
])
def test_a_note_goes_when_its_request_leaves_state_held(leave):
    res, clock = held(owner_lease_s=30)
    keep(res, "r1", {"q0": "a"})
    leave(res, clock)
    assert keep(res, "r1", {}, 0)["notes"] == {} and len(res.notes) == 0
    assert res.notes.chars == 0


def test_notes_are_bounded_per_note_and_in_all():
    notes = Notes(max_bytes=10)
    assert not notes.keep("a", "r", "x" * (MAX_NOTE + 1))
    assert notes.keep("a", "r", "x" * 6)
    assert not notes.keep("b", "r", "x" * 5)  # 11 > 10
    assert notes.keep("a", "r", "y" * 9)  # a replacement counts only itself
    assert (notes.chars, dict(notes.refused)) == (9, {"too_long": 1, "full": 1})


def test_recall_pages_by_size_and_a_later_recall_gets_only_what_came_since():
    notes = Notes(page_chars=10)
    for i in range(5):
        notes.keep(f"r{i}", "me", "n" * 4)
    notes.keep("other", "them", "z")
    got, cursor, more = {}, 0, True
    pages = 0
    while more:
        page, _, cursor, more = notes.page("me", cursor)
        got.update(page)
        pages += 1
    assert sorted(got) == [f"r{i}" for i in range(5)] and pages == 3
    assert notes.page("me", cursor) == ({}, {}, cursor, False)
    notes.keep("r9", "me", "new")
    notes.keep("r1", "me", "moved")  # replaced: comes again, with its new note
    assert notes.page("me", cursor)[0] == {"r9": "new", "r1": "moved"}


def test_dropped_notes_do_not_pile_up_in_the_order():
    notes = Notes()
    for i in range(1000):
        notes.keep(f"r{i}", "me", "n")
        notes.drop(f"r{i}")
    assert len(notes) == 0 and len(notes._seqs) < 200
    notes.keep("last", "me", "n")
    assert notes.page("me", 0)[0] == {"last": "n"}


def test_the_route_takes_notes_and_a_cursor_only_with_an_owner():
    ok = {"owner": "r", "leaseSeconds": 15, "keep": {"a": "n"}, "recall": 0}
    assert body_problem(ok) is None
    for body, word in [({"keep": {"a": "n"}}, "keep needs an owner"),
                       ({"recall": 0}, "recall needs an owner"),
                       ({**ok, "recall": True}, "recall True: must be a cursor"),
                       ({**ok, "recall": -1}, "recall -1"),
                       ({**ok, "keep": ["a"]}, "keep must be an object"),
                       ({**ok, "keep": {str(i): "n" for i in range(257)}}, "at most 256")]:
        assert word in body_problem(body), body
    assert valid_notes({"a": "n", "b": "", "c": 7, "x" * (MAX_ID + 1): "n",
                        "d": "x" * (MAX_NOTE + 1)}) == ({"a": "n"}, 4)


def test_the_utility_keeps_and_recalls_for_the_calling_owner():
    res, _ = held()
    core.install(res)
    try:
        pool = SimpleNamespace(num_gpu_blocks=100, get_num_free_blocks=lambda: 90)
        engine = SimpleNamespace(scheduler=SimpleNamespace(
            kv_cache_manager=SimpleNamespace(block_pool=pool),
            get_num_unfinished_requests=lambda: 0))
        base = {"owner": "r1", "leaseSeconds": 30}
        out = residency_utility(engine, {**base, "keep": {"q0": "a", "q1": "b"}})
        assert out["notesKept"] == 2 and "notes" not in out
        out = residency_utility(engine, {**base, "release": ["q1"], "recall": 0})
        assert out["notes"] == {"q0": "a"} and out["recallMore"] is False
        assert residency_utility(engine, {"owner": "r2", "leaseSeconds": 30,
                                          "recall": 0})["notes"] == {}
    finally:
        core.install(None)


def test_a_recall_gives_back_what_each_note_leaves_out_of_its_handle():
    # A long conversation's handle: its block ids and digest record stay on decode, which
    # issued them, and come back beside the note; the note itself stays small.
    res, _ = held(n=0)
    ids = [list(range(1000, 13_500))]
    res.retain("long", 12_500, "r1", 1e9, block_ids=ids[0],
               bulk={"remote_block_ids": ids, "bidirkv_blocks": {"v": 2}})
    res.retain("short", 2, "r1", 1e9, block_ids=[1, 2],
               bulk={"remote_block_ids": [[1, 2]]})
    keep(res, "r1", {"long": "n1", "short": "n2"})
    out = exchange(res.notes, res.lock, res.holds, "r1", {}, 0, res.bulk_of)
    assert out["notes"] == {"long": "n1", "short": "n2"}
    assert out["recallHandles"] == {
        "long": {"remote_block_ids": ids, "bidirkv_blocks": {"v": 2}},
        "short": {"remote_block_ids": [[1, 2]]}}
    # The page's bound counts them: a page of 1 KiB holds one such note at a time.
    res.notes.page_chars = 1024
    first = exchange(res.notes, res.lock, res.holds, "r1", {}, 0, res.bulk_of)
    assert list(first["notes"]) == ["long"] and first["recallMore"] is True
    assert list(first["recallHandles"]) == ["long"]
    # A request that left takes what it was issued with along.
    res.frees(["long"])
    assert res.bulk_of("long") is None
