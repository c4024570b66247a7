"""Leaving engine pods through the real operator and an API server over HTTP: a fixed-count
scale-down keeps the leaving pod in the router's config until it is gone, so its drain can
move the conversations it holds."""

from __future__ import annotations

import json

from bidirkv.operator.kube import KINDS
from kubeapi.operatorenv import api_server, di_path, eventually, resource, running_operator

MERGE = "application/merge-patch+json"


async def _decode_endpoints(client, n):
    cm = await client.get("ConfigMap", "ns1", "tiny-router")
    if cm is None:
        return None
    decode = json.loads(next(iter(cm["data"].values())))["decode"]
    return decode if len(decode) == n else None


async def set_pods(client, n):
    """What the StatefulSet controller reports while `n` pods exist (none run here)."""
    await client.call("PATCH", KINDS["StatefulSet"].path("ns1", "tiny-decode", "status"),
                      {"status": {"replicas": n}}, MERGE)


async def test_a_fixed_scale_down_keeps_the_leaving_pod_listed_until_it_is_gone(minimal):
    minimal["spec"]["decode"] = {"replicas": 2}
    async with api_server() as (server, client), running_operator(client) as op:
        await client.call("POST", di_path("ns1"), resource(minimal, "ns1"))
        await eventually(lambda: _decode_endpoints(client, 2), what="2 decode endpoints")
        await set_pods(client, 2)
        await op.idle()

        # `kubectl scale di/tiny --replicas=1`: the StatefulSet shrinks at once, the
        # router keeps decode-1 while its pod drains.
        await client.call("PATCH", di_path("ns1", "tiny", "scale"),
                          {"spec": {"replicas": 1}}, MERGE)
        await eventually(lambda: _sts_replicas(client, 1), what="StatefulSet at 1")
        await op.idle()
        assert await _decode_endpoints(client, 2)
        # The pod is gone: the router lets it go.
        await set_pods(client, 1)
        await eventually(lambda: _decode_endpoints(client, 1), what="1 decode endpoint")
        # A scale-up lists the new pod at once.
        await client.call("PATCH", di_path("ns1", "tiny", "scale"),
                          {"spec": {"replicas": 3}}, MERGE)
        await eventually(lambda: _decode_endpoints(client, 3), what="3 decode endpoints")


async def _sts_replicas(client, n):
    sts = await client.get("StatefulSet", "ns1", "tiny-decode")
    return sts if sts and sts["spec"].get("replicas") == n else None
