"""Decode keeps, beside each retained request, a note its owner left: what that router
needs to rebuild its handle entry after a restart (bidirkv/router/pool/recall.py). The
notes are opaque here: the router signs them and checks them on the way back, so decode
trusts nothing in them.

A note lives only while its request is retained (core/residency.py calls `drop`). A
caller can make decode keep one note per retained request of its own, `MAX_NOTE`
characters each and `MAX_BYTES` in all; past the total a note is refused. Recall is paged
by a cursor (every kept note gets the next sequence number), which also serves a router
that recalls again later. A note leaves out what grows with the history (block ids,
digest record: wire.NOTE_LEAVES_OUT), which decode keeps and gives back beside it
(`RECALL_HANDLES_FIELD`), so it stays a few hundred bytes however long the conversation.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from bidirkv.wire import MAX_KEEP as MAX_KEEP_NOTES
from bidirkv.wire import (
    MAX_NOTE_LEN,
    RECALL_HANDLES_FIELD,
    RECALL_MORE_FIELD,
    RECALL_NEXT_FIELD,
    RECALL_NOTES_FIELD,
)

MAX_NOTE = MAX_NOTE_LEN  # characters of one note
MAX_BYTES = 128 << 20  # characters of every note decode keeps, all owners together
PAGE_CHARS = 1 << 20  # characters of notes in one recall answer
MAX_KEEP = MAX_KEEP_NOTES  # notes in one call


@dataclass
class Notes:
    max_bytes: int = MAX_BYTES
    page_chars: int = PAGE_CHARS
    # request id -> (sequence, owner, note)
    by_rid: dict[str, tuple[int, str, str]] = field(default_factory=dict)
    # Sequences in order, with dropped ones left in until a compaction (`_seqs` holds at
    # most twice the live count), and the request each live one is for.
    _seqs: list[int] = field(default_factory=list)
    _rid_of: dict[int, str] = field(default_factory=dict)
    _next: int = 1
    chars: int = 0
    refused: Counter = field(default_factory=Counter)  # reason -> notes refused

    def __len__(self) -> int:
        return len(self.by_rid)

    def keep(self, rid: str, owner: str, note: str) -> bool:
        """Keep (or replace) the note of a retained request; False when it does not fit."""
        if len(note) > MAX_NOTE:
            return self.refuse("too_long")
        self.drop(rid)
        if self.chars + len(note) > self.max_bytes:
            return self.refuse("full")
        seq, self._next = self._next, self._next + 1
        self.by_rid[rid] = (seq, owner, note)
        self._seqs.append(seq)
        self._rid_of[seq] = rid
        self.chars += len(note)
        return True

    def refuse(self, reason: str) -> bool:
        self.refused[reason] += 1
        return False

    def drop(self, rid: str) -> None:
        old = self.by_rid.pop(rid, None)
        if old is None:
            return
        self._rid_of.pop(old[0], None)
        self.chars -= len(old[2])
        if len(self._seqs) > 2 * len(self._rid_of) + 64:
            self._seqs = [s for s in self._seqs if s in self._rid_of]

    def page(self, owner: str, after: int, bulk_of: Callable[[str], dict | None] = (
            lambda rid: None)) -> tuple[dict[str, str], dict[str, dict], int, bool]:
        """The owner's notes kept after cursor `after`, up to `page_chars` with what their
        handles were issued with (`bulk_of`): (request id -> note, request id -> those
        fields, the cursor to ask from next, whether more may follow)."""
        out: dict[str, str] = {}
        bulks: dict[str, dict] = {}
        size, cursor = 0, after
        start = bisect.bisect_right(self._seqs, after)
        for seq in self._seqs[start:]:
            rid = self._rid_of.get(seq)
            if rid is None:
                continue
            _, who, note = self.by_rid[rid]
            if who == owner:
                bulk = bulk_of(rid)
                chars = len(note) + _bulk_chars(bulk)
                if out and size + chars > self.page_chars:
                    return out, bulks, cursor, True
                out[rid] = note
                if bulk:
                    bulks[rid] = bulk
                size += chars
            cursor = seq
        # The cursor stays where the next note will land, so a later recall from it
        # returns only what was kept since.
        return out, bulks, max(cursor, self._next - 1), False


def _bulk_chars(bulk: dict | None) -> int:
    """About the JSON characters of a handle's bulk (the digest record's ~3 KB at any
    length): the page's bound, without encoding it here."""
    return 4096 if bulk else 0


def exchange(notes: Notes, lock: threading.Lock, holds: Callable[[str, str], bool],
             owner: str, keep: dict[str, str], recall: int | None,
             bulk_of: Callable[[str], dict | None] = lambda rid: None) -> dict:
    """One residency call's notes: keep those for requests `owner` holds here (`holds`,
    asked under `lock`, the lock retention's own changes drop notes under), then the page
    of a recall from cursor `recall` (None: no recall), with what each handle was issued
    with (`bulk_of`, asked under `lock` too). The answer's fields."""
    out: dict = {}
    with lock:
        if keep:
            kept = sum(1 for rid, note in keep.items()
                       if (holds(rid, owner) or notes.refuse("not_held"))
                       and notes.keep(rid, owner, note))
            out["notesKept"] = kept
        if recall is not None:
            page, bulks, cursor, more = notes.page(owner, recall, bulk_of)
            out.update({RECALL_NOTES_FIELD: page, RECALL_HANDLES_FIELD: bulks,
                        RECALL_NEXT_FIELD: cursor, RECALL_MORE_FIELD: more})
        out["notesHeld"] = len(notes)
        if notes.refused:
            out["notesRefused"] = dict(notes.refused)
    return out
