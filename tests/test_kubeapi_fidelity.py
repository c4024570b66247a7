"""The test API server changes what it stores the way kube-apiserver does, where the
operator depends on it: canonical quantities, built-in defaults, dropped empty values;
and it can fail requests and drop watches on demand."""

from __future__ import annotations

import pytest

from bidirkv.operator.kube import KINDS, ApiError
from kubeapi.operatorenv import api_server
from kubeapi.quantity import QuantityError, canonical

# What apimachinery's resource.Quantity.String() gives for each input.
CANONICAL = [
    ("0.5", "500m"), ("1024Mi", "1Gi"), ("1e3", "1e3"), ("1E3", "1e3"), ("1.5e3", "1500"),
    ("1000", "1k"), ("2000m", "2"), ("100n", "100n"), ("+1", "1"), (".5Gi", "512Mi"),
    ("1536Mi", "1536Mi"), ("0.5Ki", "512"), ("0.1Gi", "107374182400m"), ("16", "16"),
    (16, "16"), ("1.5", "1500m"), ("0.0001", "100u"), ("5.", "5"), ("0", "0"),
]


@pytest.mark.parametrize(("given", "stored"), CANONICAL)
def test_quantities_are_stored_canonically(given, stored):
    assert canonical(given) == stored


@pytest.mark.parametrize("bad", ["1K", "", ".", "1e", "abc", "1Kib"])
def test_what_the_grammar_refuses(bad):
    with pytest.raises(QuantityError):
        canonical(bad)


def statefulset(ns: str) -> dict:
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": "s", "namespace": ns},
        "spec": {
            "serviceName": "s", "selector": {"matchLabels": {"a": "b"}},
            "template": {
                "metadata": {"labels": {"a": "b"}},
                "spec": {
                    "containers": [{
                        "name": "c", "image": "img:1", "args": [],
                        "env": [{"name": "E", "value": ""}],
                        "resources": {"requests": {"cpu": "0.5", "memory": "1024Mi"}},
                        "readinessProbe": {"httpGet": {"path": "/", "port": 80}},
                        "volumeMounts": [{"name": "v", "mountPath": "/v", "readOnly": False}],
                    }],
                    "volumes": [{"name": "v", "emptyDir": {"sizeLimit": "16384Mi"}}],
                },
            },
        },
    }


async def test_a_statefulset_comes_back_as_the_api_server_keeps_it():
    async with api_server() as (_, client):
        stored = await client.create(statefulset("ns1"))
    spec = stored["spec"]
    assert spec["podManagementPolicy"] == "OrderedReady"
    assert spec["updateStrategy"] == {"type": "RollingUpdate",
                                      "rollingUpdate": {"partition": 0}}
    assert spec["revisionHistoryLimit"] == 10
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Always" and pod["terminationGracePeriodSeconds"] == 30
    c = pod["containers"][0]
    assert c["resources"]["requests"] == {"cpu": "500m", "memory": "1Gi"}
    assert c["env"] == [{"name": "E"}] and "args" not in c
    assert c["volumeMounts"] == [{"name": "v", "mountPath": "/v"}]
    assert c["readinessProbe"]["timeoutSeconds"] == 1
    assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTP"
    assert c["imagePullPolicy"] == "IfNotPresent"
    assert pod["volumes"][0]["emptyDir"] == {"sizeLimit": "16Gi"}


async def test_injected_faults_fail_exactly_the_matching_requests():
    async with api_server() as (server, client):
        server.inject("create", "statefulsets", 500)
        with pytest.raises(ApiError) as err:
            await client.create(statefulset("ns1"))
        assert err.value.status == 500
        created = await client.create(statefulset("ns1"))
        server.inject("update", "statefulsets", 409, times=2)
        for _ in range(2):
            with pytest.raises(ApiError) as err:
                await client.replace(created)
            assert err.value.status == 409 and err.value.reason == "Conflict"
        await client.replace(created)
        server.inject("patch", "statefulsets", 429, subresource="status")
        path = KINDS["StatefulSet"].path("ns1", "s", "status")
        with pytest.raises(ApiError) as err:
            await client.call("PATCH", path, {"status": {"replicas": 1}},
                              "application/merge-patch+json")
        assert err.value.status == 429
