"""The in-memory Kubernetes API server, exercised through real clients over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
from collections.abc import AsyncIterator, Iterator

import aiohttp
import kopf
import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from kubeapi.crdschema import validate_custom_resource
from kubeapi.patch import strategic_merge_patch
from kubeapi.server import KubeAPIServer, Request, running_kubeapi

GROUP, VERSION, PLURAL, KIND = "testing.bidirkv.io", "v1", "widgets", "Widget"

WIDGET_SCHEMA = {
    "type": "object",
    "properties": {
        "spec": {
            "type": "object",
            "required": ["model"],
            "x-kubernetes-validations": [{
                "rule": "self.minReplicas <= self.replicas",
                "message": "minReplicas must not exceed replicas",
                "fieldPath": ".minReplicas",
            }],
            "properties": {
                "model": {
                    "type": "string", "minLength": 1,
                    "x-kubernetes-validations": [
                        {"rule": "self == oldSelf", "message": "model is immutable"},
                    ],
                },
                "replicas": {"type": "integer", "minimum": 0, "maximum": 16, "default": 1},
                "minReplicas": {"type": "integer", "default": 0},
                "mode": {"type": "string", "enum": ["fast", "safe"], "default": "safe"},
                "router": {
                    "type": "object", "default": {},
                    "properties": {
                        "conversationTtlSeconds": {
                            "type": "integer", "default": 600,
                            "x-kubernetes-validations": [
                                {"rule": "self >= 60", "message": "must be at least 60 seconds"},
                            ],
                        },
                        "policy": {"type": "string", "default": "prefix"},
                    },
                },
                "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            },
        },
        "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    },
}

WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"{PLURAL}.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {"plural": PLURAL, "singular": "widget", "kind": KIND, "shortNames": ["wd"]},
        "versions": [{
            "name": VERSION, "served": True, "storage": True,
            "schema": {"openAPIV3Schema": WIDGET_SCHEMA},
            "subresources": {
                "status": {},
                "scale": {"specReplicasPath": ".spec.replicas",
                          "statusReplicasPath": ".status.replicas",
                          "labelSelectorPath": ".status.selector"},
            },
        }],
    },
}


def widget(name: str, **spec) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
            "metadata": {"name": name}, "spec": {"model": "llama", **spec}}


def deployment(name: str) -> dict:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [
                    {"name": "engine", "image": "vllm:1",
                     "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                     "ports": [{"containerPort": 8000}]},
                    {"name": "sidecar", "image": "proxy:1"},
                ]},
            },
        },
    }


def statefulset(name: str, replicas: int = 2) -> dict:
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas, "serviceName": name,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}},
                         "spec": {"containers": [{"name": "c", "image": "i"}]}},
        },
    }


# Fixtures -----------------------------------------------------------------------------------

@pytest.fixture
def server() -> Iterator[KubeAPIServer]:
    with running_kubeapi() as srv:
        yield srv


@pytest.fixture
def api(server: KubeAPIServer) -> Iterator[k8s.ApiClient]:
    # Explicit configuration: never KUBECONFIG or in-cluster settings.
    with k8s.ApiClient(k8s.Configuration(host=server.url)) as api_client:
        yield api_client


@pytest.fixture
def widgets(api: k8s.ApiClient) -> k8s.CustomObjectsApi:
    k8s.ApiextensionsV1Api(api).create_custom_resource_definition(copy.deepcopy(WIDGET_CRD))
    return k8s.CustomObjectsApi(api)


@pytest.fixture
async def aserver() -> AsyncIterator[KubeAPIServer]:
    async with KubeAPIServer() as srv:
        yield srv


def error_of(exc: pytest.ExceptionInfo[ApiException]) -> dict:
    return json.loads(exc.value.body)


# Official kubernetes client -----------------------------------------------------------------

def test_create_get_and_list_with_label_selector(api: k8s.ApiClient) -> None:
    core = k8s.CoreV1Api(api)
    body = {"metadata": {"name": "a", "labels": {"tier": "router"}}, "data": {"k": "v"}}
    created, code, _ = core.create_namespaced_config_map_with_http_info("default", body)
    core.create_namespaced_config_map(
        "default", {"metadata": {"generateName": "b-", "labels": {"tier": "engine"}}})

    assert code == 201
    meta = created.metadata
    assert meta.uid and meta.resource_version.isdigit() and meta.creation_timestamp
    assert meta.namespace == "default" and meta.generation == 1
    assert core.read_namespaced_config_map("a", "default").data == {"k": "v"}
    listed = core.list_config_map_for_all_namespaces(label_selector="tier in (router,x)")
    assert [cm.metadata.name for cm in listed.items] == ["a"]
    others = core.list_namespaced_config_map("default", label_selector="tier!=router")
    assert [cm.metadata.name[:2] for cm in others.items] == ["b-"]
    by_field = core.list_config_map_for_all_namespaces(field_selector="metadata.name=a")
    assert [cm.metadata.name for cm in by_field.items] == ["a"]
    assert core.list_namespaced_config_map("kube-system").items == []
    assert int(listed.metadata.resource_version) >= int(meta.resource_version)


def test_errors_are_status_objects(api: k8s.ApiClient) -> None:
    core = k8s.CoreV1Api(api)
    core.create_namespaced_config_map("default", {"metadata": {"name": "a"}})
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_config_map("default", {"metadata": {"name": "a"}})
    assert exc.value.status == 409 and error_of(exc)["reason"] == "AlreadyExists"
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_config_map("missing", "default")
    status = error_of(exc)
    assert (status["kind"], status["code"], status["reason"]) == ("Status", 404, "NotFound")
    assert status["message"] == 'configmaps "missing" not found'
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_config_map("nowhere", {"metadata": {"name": "a"}})
    assert exc.value.status == 404 and "namespaces" in error_of(exc)["message"]
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_config_map("default", {"metadata": {"name": "Bad_Name"}})
    assert exc.value.status == 422 and error_of(exc)["reason"] == "Invalid"
    with pytest.raises(ApiException) as exc:  # how kopf detects a concurrent change
        core.patch_namespaced_config_map("a", "default", [
            {"op": "test", "path": "/metadata/resourceVersion", "value": "0"},
            {"op": "add", "path": "/data", "value": {"x": "y"}}])
    assert exc.value.status == 422 and error_of(exc)["reason"] == "Invalid"
    with pytest.raises(ApiException) as exc:
        core.list_namespaced_config_map("default", label_selector="a in b")
    assert exc.value.status == 400 and error_of(exc)["reason"] == "BadRequest"
    assert core.read_namespaced_config_map("a", "default").data is None


def test_replace_with_stale_resource_version_conflicts(api: k8s.ApiClient) -> None:
    core = k8s.CoreV1Api(api)
    first = core.create_namespaced_config_map("default", {"metadata": {"name": "c"}})
    first.data = {"v": "1"}
    core.replace_namespaced_config_map("c", "default", first)
    first.data = {"v": "2"}
    with pytest.raises(ApiException) as exc:
        core.replace_namespaced_config_map("c", "default", first)  # still carries the old rv
    assert exc.value.status == 409 and error_of(exc)["reason"] == "Conflict"

    unconditional = {"metadata": {"name": "c"}, "data": {"v": "3"}}
    assert core.replace_namespaced_config_map("c", "default", unconditional).data == {"v": "3"}


def test_strategic_merge_patch_keeps_other_containers(api: k8s.ApiClient) -> None:
    apps = k8s.AppsV1Api(api)
    apps.create_namespaced_deployment("default", deployment("web"))
    patch = {"spec": {"template": {"spec": {"containers": [
        {"name": "engine", "env": [{"name": "B", "value": "20"}, {"name": "C", "value": "3"}]},
    ]}}}}
    patched = apps.patch_namespaced_deployment("web", "default", patch)  # strategic by default

    containers = {c.name: c for c in patched.spec.template.spec.containers}
    assert set(containers) == {"engine", "sidecar"}
    env = {e.name: e.value for e in containers["engine"].env}
    assert env == {"A": "1", "B": "20", "C": "3"}
    assert containers["engine"].image == "vllm:1"
    assert patched.metadata.generation == 2


def test_status_subresource_is_split_from_the_main_resource(api: k8s.ApiClient) -> None:
    apps = k8s.AppsV1Api(api)
    sts = apps.create_namespaced_stateful_set("default", statefulset("db"))
    assert sts.status is None or not sts.status.replicas

    body = apps.read_namespaced_stateful_set("db", "default").to_dict()
    body["status"] = {"replicas": 9}
    body["metadata"]["labels"] = {"touched": "yes"}
    updated = apps.replace_namespaced_stateful_set("db", "default", body)
    assert updated.metadata.labels == {"touched": "yes"}
    assert updated.status is None or updated.status.replicas != 9  # status ignored on main
    assert updated.metadata.generation == 1  # spec unchanged

    status = apps.patch_namespaced_stateful_set_status(
        "db", "default", {"status": {"replicas": 2, "readyReplicas": 1},
                          "spec": {"replicas": 7}})
    assert status.status.ready_replicas == 1 and status.spec.replicas == 2  # spec ignored here
    assert status.metadata.generation == 1


def test_scale_subresource_on_a_statefulset(api: k8s.ApiClient) -> None:
    apps = k8s.AppsV1Api(api)
    apps.create_namespaced_stateful_set("default", statefulset("db", replicas=2))
    apps.patch_namespaced_stateful_set_status("db", "default", {"status": {"replicas": 2}})

    scale = apps.read_namespaced_stateful_set_scale("db", "default")
    assert (scale.spec.replicas, scale.status.replicas, scale.status.selector) == (2, 2, "app=db")
    scaled = apps.patch_namespaced_stateful_set_scale("db", "default", {"spec": {"replicas": 5}})
    assert scaled.spec.replicas == 5
    sts = apps.read_namespaced_stateful_set("db", "default")
    assert sts.spec.replicas == 5 and sts.metadata.generation == 2


def test_custom_resources_via_custom_objects_api(
        server: KubeAPIServer, api: k8s.ApiClient, widgets: k8s.CustomObjectsApi) -> None:
    crd = k8s.ApiextensionsV1Api(api).read_custom_resource_definition(f"{PLURAL}.{GROUP}")
    conditions = {c.type: c.status for c in crd.status.conditions}
    assert conditions == {"NamesAccepted": "True", "Established": "True"}
    assert crd.status.accepted_names.kind == KIND and crd.status.stored_versions == [VERSION]
    created = widgets.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL,
                                                      widget("w1", replicas=2))
    assert created["metadata"]["uid"] and created["metadata"]["generation"] == 1

    got = widgets.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "w1")
    assert got["spec"]["replicas"] == 2
    listed = widgets.list_cluster_custom_object(GROUP, VERSION, PLURAL)
    assert listed["kind"] == "WidgetList" and [i["kind"] for i in listed["items"]] == [KIND]

    patched = widgets.patch_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "w1",
                                                     {"spec": {"replicas": 3}})
    assert patched["spec"]["replicas"] == 3 and patched["metadata"]["generation"] == 2
    status = widgets.patch_namespaced_custom_object_status(
        GROUP, VERSION, "default", PLURAL, "w1", {"status": {"phase": "Ready"}})
    assert status["status"] == {"phase": "Ready"} and status["metadata"]["generation"] == 2
    assert server.get(f"{GROUP}/{VERSION}", PLURAL, "default", "w1")["status"]["phase"] == "Ready"

    widgets.patch_namespaced_custom_object_status(
        GROUP, VERSION, "default", PLURAL, "w1", {"status": {"replicas": 1, "selector": "a=b"}})
    scale = widgets.get_namespaced_custom_object_scale(GROUP, VERSION, "default", PLURAL, "w1")
    assert (scale["spec"]["replicas"], scale["status"]) == (3, {"replicas": 1, "selector": "a=b"})
    widgets.patch_namespaced_custom_object_scale(GROUP, VERSION, "default", PLURAL, "w1",
                                                 {"spec": {"replicas": 4}})
    assert server.get(f"{GROUP}/{VERSION}", PLURAL, "default", "w1")["spec"]["replicas"] == 4


def test_invalid_custom_resource_is_rejected_with_causes(
        server: KubeAPIServer, widgets: k8s.CustomObjectsApi) -> None:
    bad = widget("bad", replicas=99, mode="turbo")
    before = server.resource_version
    with pytest.raises(ApiException) as exc:
        widgets.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, bad)

    status = error_of(exc)
    assert exc.value.status == 422 and status["reason"] == "Invalid"
    causes = {c["field"]: c["message"] for c in status["details"]["causes"]}
    assert "spec.replicas" in causes and "less than or equal to 16" in causes["spec.replicas"]
    assert causes["spec.mode"].startswith('Unsupported value: "turbo"')
    assert status["message"].startswith(f'{KIND}.{GROUP} "bad" is invalid: [spec.')
    assert server.resource_version == before  # nothing stored
    assert server.get(f"{GROUP}/{VERSION}", PLURAL, "default", "bad") is None


def test_custom_resource_defaults_and_pruning(widgets: k8s.CustomObjectsApi) -> None:
    body = widget("w", unknown="x", extra={"free": {"form": 1}})
    body["metadata"]["bogus"] = True
    created = widgets.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, body)

    spec = created["spec"]
    assert "unknown" not in spec and "bogus" not in created["metadata"]
    assert spec["extra"] == {"free": {"form": 1}}  # preserve-unknown-fields
    assert (spec["replicas"], spec["minReplicas"], spec["mode"]) == (1, 0, "safe")
    assert spec["router"] == {"conversationTtlSeconds": 600, "policy": "prefix"}


def test_cel_rule_failures_report_message_and_field_path(
        widgets: k8s.CustomObjectsApi) -> None:
    with pytest.raises(ApiException) as exc:
        widgets.create_namespaced_custom_object(
            GROUP, VERSION, "default", PLURAL,
            widget("w", replicas=1, minReplicas=4, router={"conversationTtlSeconds": 5}))
    message = error_of(exc)["message"]
    assert 'spec.minReplicas: Invalid value: "object": minReplicas must not exceed replicas' \
        in message
    assert ('spec.router.conversationTtlSeconds: Invalid value: "integer": must be at least 60 '
            'seconds') in message

    widgets.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, widget("w"))
    with pytest.raises(ApiException) as exc:  # transition rule, only checked on update
        widgets.patch_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "w",
                                               {"spec": {"model": "mistral"}})
    assert "spec.model: Invalid value: \"string\": model is immutable" in error_of(exc)["message"]


def test_delete_waits_for_finalizers(server: KubeAPIServer, api: k8s.ApiClient) -> None:
    core = k8s.CoreV1Api(api)
    core.create_namespaced_config_map(
        "default", {"metadata": {"name": "f", "finalizers": ["example.com/keep"]}})
    core.delete_namespaced_config_map("f", "default")

    pending = core.read_namespaced_config_map("f", "default")
    assert pending.metadata.deletion_timestamp is not None
    with pytest.raises(ApiException) as exc:  # no new finalizers once deleting
        core.patch_namespaced_config_map(
            "f", "default", {"metadata": {"finalizers": ["example.com/keep", "other.io/x"]}})
    assert exc.value.status == 422
    core.patch_namespaced_config_map("f", "default", [
        {"op": "remove", "path": "/metadata/finalizers/0"}])
    assert server.get("v1", "configmaps", "default", "f") is None


def test_kubeconfig_file_and_request_log(server: KubeAPIServer, tmp_path) -> None:
    path = server.write_kubeconfig(tmp_path / "kubeconfig")
    api_client = k8s_config.new_client_from_config(config_file=str(path))
    core = k8s.CoreV1Api(api_client)
    server.requests.clear()

    names = [ns.metadata.name for ns in core.list_namespace().items]
    assert names == ["default", "kube-system"]
    assert not server.writes()
    core.create_namespace({"metadata": {"name": "team"}})
    core.delete_namespace("team")
    assert server.writes() == [
        Request("create", "", "v1", "namespaces", "", "", ""),
        Request("delete", "", "v1", "namespaces", "", "", "team"),
    ]
    assert server.requests[0] == Request("list", "", "v1", "namespaces", "", "", "")
    api_client.close()


def test_pure_validation_function() -> None:
    obj, errors = validate_custom_resource(
        WIDGET_CRD, widget("x", replicas=3.0, router={"conversationTtlSeconds": 10}))
    assert type(obj["spec"]["replicas"]) is int  # integral JSON number on an integer field
    assert [str(e) for e in errors] == [
        'spec.router.conversationTtlSeconds: Invalid value: "integer": must be at least 60 '
        'seconds']
    _, errors = validate_custom_resource(WIDGET_CRD, widget("x", replicas="many"))
    assert errors[0].field == "spec.replicas" and errors[0].type == "FieldValueTypeInvalid"
    assert "some validation rules were not checked" in str(errors[-1])  # CEL blocked
    old = widget("x")
    _, errors = validate_custom_resource(WIDGET_CRD, widget("x", model="other"), old=old)
    assert [e.detail for e in errors] == ["model is immutable"]

    crd = copy.deepcopy(WIDGET_CRD)
    spec_schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec_schema["x-kubernetes-validations"] = [{
        "rule": "self.replicas % 2 == 0", "reason": "FieldValueForbidden",
        "messageExpression": "'replicas must be even, got ' + string(self.replicas)"}]
    _, errors = validate_custom_resource(crd, widget("x", replicas=3))
    assert [str(e) for e in errors] == ["spec: Forbidden: replicas must be even, got 3"]


CEL_RULES_THAT_HOLD = [
    "has(self.title) && !has(self.missing)",
    "size(self.title) == 4 && self.title.size() == 4",
    "self.title.startsWith('vL') && self.title.endsWith('Lm') && self.title.matches('^v[A-Z]+m$')",
    "'a' in self.tags && !('z' in self.tags)",
    "self.tags.all(t, t.size() == 1) && self.tags.exists(t, t == 'b')",
    "self.tags.exists_one(t, t == 'a') && self.tags.map(t, t + t) == ['aa', 'bb']",
    "self.count > 2 && self.count * 2 == 6 && self.count == 3.0",  # int field: CEL int
    "self.ratio > 0.2 && self.ratio < 1",  # number field: CEL double, mixed comparison
    "self.labels['tier'] == 'x' && 'tier' in self.labels",
    "self.title.lowerAscii() == 'vllm' && self.title.split('L') == ['v', '', 'm']",
    "self.tags.filter(t, t != 'a') == ['b'] && self.tags.isSorted()",
    "self.dash__dash__field == 1 && self.__namespace__ == 'ns'",  # escaped property names
]


@pytest.mark.parametrize("rule", CEL_RULES_THAT_HOLD)
def test_cel_rules_supported(rule: str) -> None:
    crd = copy.deepcopy(WIDGET_CRD)
    spec_schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec_schema["properties"].update({
        "title": {"type": "string"}, "count": {"type": "integer"},
        "ratio": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "dash-field": {"type": "integer"}, "namespace": {"type": "string"},
    })
    obj = widget("x", title="vLLm", count=3, ratio=0.5, tags=["a", "b"], labels={"tier": "x"},
                 **{"dash-field": 1, "namespace": "ns"})
    spec_schema["x-kubernetes-validations"] = [{"rule": rule}]
    _, errors = validate_custom_resource(crd, obj, strict_cel=True)
    assert errors == []
    spec_schema["x-kubernetes-validations"] = [{"rule": f"!({rule})", "message": "negated"}]
    _, errors = validate_custom_resource(crd, obj, strict_cel=True)
    assert [str(e) for e in errors] == ['spec: Invalid value: "object": negated']


def test_strategic_merge_directives() -> None:
    doc = {"metadata": {"finalizers": ["a"]},
           "spec": {"containers": [{"name": "x", "image": "1"}, {"name": "y", "image": "2"}],
                    "tolerations": [{"key": "k"}]}}
    patch = {"metadata": {"finalizers": ["b"]},
             "spec": {"containers": [{"name": "y", "$patch": "delete"}],
                      "tolerations": [{"key": "other"}]}}
    out = strategic_merge_patch(doc, patch)
    assert out["metadata"]["finalizers"] == ["a", "b"]
    assert out["spec"]["containers"] == [{"name": "x", "image": "1"}]
    assert out["spec"]["tolerations"] == [{"key": "other"}]  # no merge key: replaced


def test_garbage_collector_deletes_dependents() -> None:
    with running_kubeapi(gc=True) as srv, k8s.ApiClient(k8s.Configuration(host=srv.url)) as a:
        core = k8s.CoreV1Api(a)
        owner = core.create_namespaced_config_map("default", {"metadata": {"name": "owner"}})
        ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
               "uid": owner.metadata.uid}
        core.create_namespaced_secret(
            "default", {"metadata": {"name": "dep", "ownerReferences": [ref]}})
        core.delete_namespaced_config_map("owner", "default")
        assert srv.get("v1", "secrets", "default", "dep") is None


# Watch over raw aiohttp ---------------------------------------------------------------------

async def _events(response: aiohttp.ClientResponse, count: int) -> list[tuple[str, str]]:
    out = []
    while len(out) < count:
        line = await asyncio.wait_for(response.content.readline(), 5)
        assert line, f"stream ended after {out}"
        event = json.loads(line)
        out.append((event["type"], event["object"]["metadata"].get("name", "")))
    return out


async def test_watch_streams_added_modified_deleted_in_order(aserver: KubeAPIServer) -> None:
    cms = "/api/v1/namespaces/default/configmaps"
    async with aiohttp.ClientSession(aserver.url) as http:
        await http.post(cms, json={"metadata": {"name": "old"}})
        for flag in ("true", "True", "1"):
            async with http.get(cms, params={"watch": flag, "timeoutSeconds": "1"}) as resp:
                assert await _events(resp, 1) == [("ADDED", "old")]
        async with http.get(cms, params={"watch": "true"}) as resp:
            assert await _events(resp, 1) == [("ADDED", "old")]
            await http.post(cms, json={"metadata": {"name": "new"}})
            await http.patch(f"{cms}/new", json={"data": {"a": "b"}},
                             headers={"Content-Type": "application/merge-patch+json"})
            await http.delete(f"{cms}/old")
            assert await _events(resp, 3) == [
                ("ADDED", "new"), ("MODIFIED", "new"), ("DELETED", "old")]


async def test_watch_resumes_from_resource_version(aserver: KubeAPIServer) -> None:
    cms = "/api/v1/namespaces/default/configmaps"
    async with aiohttp.ClientSession(aserver.url) as http:
        first = await (await http.post(cms, json={"metadata": {"name": "a"}})).json()
        await http.post(cms, json={"metadata": {"name": "b"}})
        await http.delete(f"{cms}/a")
        params = {"watch": "true", "resourceVersion": first["metadata"]["resourceVersion"]}
        async with http.get(cms, params=params) as resp:
            assert await _events(resp, 2) == [("ADDED", "b"), ("DELETED", "a")]


async def test_watch_expired_and_timeout() -> None:
    async with KubeAPIServer(history=3) as srv, aiohttp.ClientSession(srv.url) as http:
        cms = "/api/v1/namespaces/default/configmaps"
        for i in range(5):
            await http.post(cms, json={"metadata": {"name": f"c{i}"}})
        async with http.get(cms, params={"watch": "1", "resourceVersion": "1"}) as resp:
            event = json.loads(await resp.content.readline())
        assert event["type"] == "ERROR" and event["object"]["code"] == 410
        assert event["object"]["reason"] == "Expired"

        params = {"watch": "1", "resourceVersion": str(srv.resource_version),
                  "timeoutSeconds": "2", "allowWatchBookmarks": "true"}
        async with http.get(cms, params=params) as resp:
            # Open until timeoutSeconds, not closed at once: a change made after the
            # watch started still reaches it...
            await http.post(cms, json={"metadata": {"name": "late"}})
            # ...and then the server ends the watch itself (the bound only keeps a hang
            # from lasting), with a bookmark.
            body = await asyncio.wait_for(resp.text(), 30)
        events = [json.loads(line) for line in body.splitlines()]
        assert [(e["type"], e["object"]["metadata"].get("name")) for e in events][0] == \
            ("ADDED", "late")
        assert [e["type"] for e in events] == ["ADDED", "BOOKMARK"]


async def test_stop_closes_open_watches() -> None:
    srv = KubeAPIServer()
    await srv.start()
    async with aiohttp.ClientSession(srv.url) as http:
        async with http.get("/api/v1/configmaps", params={"watch": "true"}) as resp:
            await srv.stop()
            # Ends because the server closed it: a watch left open would run into the
            # bound (its timeout fails the test), however fast the machine.
            with contextlib.suppress(aiohttp.ClientPayloadError):
                await asyncio.wait_for(resp.read(), 30)
    assert resp.connection is None  # released: the stream is over


async def test_discovery_and_crd_lifecycle(aserver: KubeAPIServer) -> None:
    async with aiohttp.ClientSession(aserver.url) as http:
        async def get(path: str) -> tuple[int, dict]:
            async with http.get(path) as resp:
                return resp.status, await resp.json()

        assert (await get("/version"))[1]["gitVersion"] == "v1.33.0"
        assert (await get("/version/"))[1]["gitVersion"] == "v1.33.0"
        async with http.post("/api/v1/namespaces/default/configmaps/x", json={}) as resp:
            assert (resp.status, (await resp.json())["reason"]) == (405, "MethodNotAllowed")
        assert (await get("/api/v1"))[1]["groupVersion"] == "v1"
        apps = {r["name"]: r for r in (await get("/apis/apps/v1"))[1]["resources"]}
        assert apps["statefulsets"]["shortNames"] == ["sts"]
        assert apps["statefulsets/status"]["verbs"] == ["get", "patch", "update"]
        assert apps["deployments/scale"]["kind"] == "Scale"
        assert apps["deployments/scale"]["group"] == "autoscaling"
        assert (await get(f"/apis/{GROUP}/{VERSION}"))[0] == 404

        crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        assert (await http.post(crds, json=WIDGET_CRD)).status == 201
        groups = [g["name"] for g in (await get("/apis"))[1]["groups"]]
        assert GROUP in groups
        resources = {r["name"]: r for r in (await get(f"/apis/{GROUP}/{VERSION}"))[1]["resources"]}
        assert set(resources) == {PLURAL, f"{PLURAL}/status", f"{PLURAL}/scale"}
        assert resources[PLURAL]["shortNames"] == ["wd"] and resources[PLURAL]["namespaced"]

        path = f"/apis/{GROUP}/{VERSION}/namespaces/default/{PLURAL}"
        assert (await http.post(path, json=widget("w"))).status == 201
        assert (await http.delete(f"{crds}/{PLURAL}.{GROUP}")).status == 200
        assert (await get(f"/apis/{GROUP}/{VERSION}"))[0] == 404
        assert (await get(path))[0] == 404
        assert (await http.post(crds, json=WIDGET_CRD)).status == 201
        assert (await get(path))[1]["items"] == []  # the old objects went with the CRD


# A real kopf operator -----------------------------------------------------------------------

@pytest.mark.timeout(60)
async def test_kopf_operator_runs_handlers_and_patches(aserver: KubeAPIServer) -> None:
    registry = kopf.OperatorRegistry()
    created, deleted = asyncio.Event(), asyncio.Event()

    @kopf.on.login(registry=registry)
    def login(**_) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=aserver.url, scheme=None, insecure=True)

    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry, id="on_create")
    async def on_create(spec, patch, body, **_) -> dict:
        patch.status["phase"] = "Ready"
        kopf.info(body, reason="Handled", message="widget handled")
        created.set()
        return {"model": spec["model"]}

    @kopf.on.delete(GROUP, VERSION, PLURAL, registry=registry, id="on_delete")
    async def on_delete(**_) -> None:
        deleted.set()

    settings = kopf.OperatorSettings()
    settings.queueing.idle_timeout = settings.queueing.exit_timeout = 0.5
    settings.networking.error_backoffs = [0.1, 0.2, 0.5]
    settings.networking.request_timeout = 10
    settings.watching.reconnect_backoff = 0.1
    settings.posting.level = logging.INFO

    path = f"/apis/{GROUP}/{VERSION}/namespaces/default/{PLURAL}"
    async with aiohttp.ClientSession(aserver.url) as http:
        resp = await http.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                               json=WIDGET_CRD)
        assert resp.status == 201
        stop, ready = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(kopf.operator(
            registry=registry, settings=settings, clusterwide=True, standalone=True,
            stop_flag=stop, ready_flag=ready))
        try:
            await asyncio.wait_for(ready.wait(), 10)
            assert (await http.post(path, json=widget("w1"))).status == 201
            await asyncio.wait_for(created.wait(), 10)

            async def landed() -> dict:
                while True:
                    obj = aserver.get(f"{GROUP}/{VERSION}", PLURAL, "default", "w1") or {}
                    if obj.get("status", {}).get("on_create") and obj["metadata"].get(
                            "finalizers") and obj["status"].get("phase"):
                        return obj
                    await asyncio.sleep(0.05)

            obj = await asyncio.wait_for(landed(), 10)
            assert obj["status"]["phase"] == "Ready"
            assert obj["status"]["on_create"] == {"model": "llama"}
            assert obj["metadata"]["finalizers"] == ["kopf.zalando.org/KopfFinalizerMarker"]
            status_writes = [r for r in aserver.writes() if r.subresource == "status"]
            assert status_writes and status_writes[0].verb == "patch"

            assert (await http.delete(f"{path}/w1")).status == 200
            await asyncio.wait_for(deleted.wait(), 10)

            async def gone() -> None:  # kopf's finalizer removal lets the object go
                while aserver.get(f"{GROUP}/{VERSION}", PLURAL, "default", "w1") is not None:
                    await asyncio.sleep(0.05)

            await asyncio.wait_for(gone(), 10)

            async def event_posted() -> None:  # kopf posts k8s events in the background
                while not any(e["reason"] == "Handled" and e["involvedObject"]["name"] == "w1"
                              for e in aserver.list("v1", "events", "default")):
                    await asyncio.sleep(0.05)

            await asyncio.wait_for(event_posted(), 10)
        finally:
            stop.set()
            # The operator stops when asked; the bound only keeps a hang from lasting.
            await asyncio.wait_for(task, 30)
