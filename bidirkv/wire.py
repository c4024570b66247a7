"""The wire between the router and the engine plugin: every key and path either side
writes for the other, named once, here, with the version both check. Owned by neither
side (as bidirkv/proof.py is); docs/protocol.md lists the same table and a test holds
the two equal.

`VERSION` changes whenever a key below changes meaning or a new one becomes required:
each side refuses what the other sent under another version instead of guessing
(docs/protocol.md, Wire version, says how each side refuses, and what each version
changed).
"""

from __future__ import annotations

from typing import Any

VERSION = 3
# kv_transfer_params, router -> engines (both legs)
VERSION_KEY = "bidirkv_wire"  # the sender's VERSION (also in D's handle, engine -> router)
PROOF_KEY = "bidirkv_proof"  # the router's single-use proof (bidirkv/proof.py)
OWNER_KEY = "bidirkv_owner"  # who decode keeps the retained blocks for (decode leg)
# A label of the request's tenant, for fair reclaiming on decode (hex of the router's
# keyed tenant hash, never a credential; decode leg).
TENANT_KEY = "bidirkv_tenant"
# Seconds the router expects between this turn's answer and its conversation's next turn
# (bidirkv/returns.py; decode leg, optional): what decode releases by under pressure.
RETURN_KEY = "bidirkv_return_s"
# kv_transfer_params, engine -> router -> the peer engine (a handle)
MAC_KEY = "bidirkv_mac"  # the handle's signature (connector/core/handles.py)
BLOCKS_KEY = "bidirkv_blocks"  # digests of what the issuer's blocks hold
EXPIRES_KEY = "bidirkv_expires"  # the issuer's wall-clock deadline for them
# A handle's blocks per KV group, in place of vLLM's `remote_block_ids`, which the reader
# receives from the issuer when it asks before its read.
COUNTS_KEY = "bidirkv_block_counts"
# kv_transfer_params, router -> P beside a handle it does not spend (optional): a child's
# read of its parent's blocks, which decode keeps for the parent's own next turn.
SHARED_KEY = "bidirkv_shared"
# The decode request id a shared read asks for and notifies with: decode tells it from
# the read that spends the handle (side channel, NIXL notification).
SHARE_PREFIX = "bidirkv-share:"
# kv_transfer_params, D -> router beside a handle (optional): how many of its blocks D
# already kept for other requests when it retained this one (a fork's prefix shared with
# its parent, an extend's history with the turn it extends). Decode pins a block once;
# the router counts it once too (router/datapath/keeping.py) and never sends it on.
SHARED_BLOCKS_KEY = "bidirkv_shared_blocks"
# kv_transfer_params, P -> router (prefill leg reply): the reuse report
REPORT_KEY = "bidirkv"
# HTTP, router -> each decode engine: leases and releases of retained KV
RESIDENCY_PATH = "/bidirkv/residency"
RESIDENCY_VERSION_FIELD = "wire"  # in the JSON body; VERSION
# In the same body: notes the router leaves beside retained requests (request id ->
# note), and the cursor it recalls them from; the answer's notes and next cursor.
RESIDENCY_KEEP_FIELD = "keep"
RECALL_FIELD = "recall"
RECALL_NOTES_FIELD = "notes"
RECALL_NEXT_FIELD = "recallNext"
RECALL_MORE_FIELD = "recallMore"
# Beside a recalled page: what each note leaves out of its handle (NOTE_LEAVES_OUT), from
# the handle decode issued for that request (request id -> those fields).
RECALL_HANDLES_FIELD = "recallHandles"
# The part of a handle a note leaves out, ~3 KB at any length (the digest record): a
# note stays a few hundred bytes; decode, which issued it, gives it back.
NOTE_LEAVES_OUT = (BLOCKS_KEY,)

# Decode keeps at most this much of a tenant label: a direct caller cannot grow its
# memory with it; the router sends TENANT_LABEL_LEN.
MAX_TENANT_LEN = 64
TENANT_LABEL_LEN = 32
# A router's note beside a retained request, and the notes one residency call keeps: what
# decode takes, and what the router sends (a longer note is not sent).
MAX_NOTE_LEN = 65_536
MAX_KEEP = 256

KEYS = {name: value for name, value in dict(globals()).items()
        if name.endswith(("_KEY", "_PATH", "_FIELD")) and isinstance(value, str)}


def version_problem(version: Any, what: str) -> str | None:
    """Why `what` of wire version `version` cannot be taken here (None: it can)."""
    if version == VERSION and not isinstance(version, bool):
        return None
    return (f"{what} speaks bidir-kv wire version {version!r}; this side speaks {VERSION} "
            "(upgrade the router and the engines to one release)")
