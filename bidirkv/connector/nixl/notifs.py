"""Decode's NIXL notifications with the shared reads taken out.

A reader notifies the issuer once it has read a request's blocks, and vLLM frees them
when every reader did. A child's read of its parent's retained blocks must leave them
retained (core/residency.py, `share`): it names the request with SHARE_PREFIX, and its
notification is taken out here, in the worker, before vLLM sees it. The worker hands the
requests so read to the scheduler's side with the step's output (`SharedReadsDone`,
vLLM's worker-to-scheduler metadata), where the residency counts each shared read done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from bidirkv.wire import SHARE_PREFIX

_PREFIX = SHARE_PREFIX.encode()


def shared_request(notif: bytes) -> str | None:
    """The request a shared read's notification (`<prefix><request id>:<readers>`) names,
    or None for any other notification."""
    if not notif.startswith(_PREFIX):
        return None
    rid = notif[len(_PREFIX):].decode("utf-8", "replace").rpartition(":")[0]
    return rid or None


@dataclass
class SharedReadsDone(KVConnectorWorkerMetadata):
    """The requests whose shared reads notified this step, one entry a notification."""

    req_ids: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, SharedReadsDone):
            return self
        return SharedReadsDone(self.req_ids + other.req_ids)


class SharedNotifs:
    """vLLM's NIXL agent, whose `get_new_notifs` leaves out shared reads' notifications
    and keeps their requests for `take` (everything else is the agent's own). Polled and
    taken on the worker's model thread, step after step."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self._done: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def get_new_notifs(self) -> dict[Any, list[bytes]]:
        out: dict[Any, list[bytes]] = {}
        for agent, notifs in self._agent.get_new_notifs().items():
            kept = []
            for notif in notifs:
                rid = shared_request(notif)
                if rid is None:
                    kept.append(notif)
                else:
                    self._done.append(rid)
            if kept:
                out[agent] = kept
        return out

    def take(self) -> SharedReadsDone | None:
        """The shared reads done since the last call, for the scheduler's side."""
        if not self._done:
            return None
        done, self._done = self._done, []
        return SharedReadsDone(done)
