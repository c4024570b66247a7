import pathlib

import crdref
import pytest
import yaml

from bidirkv.operator.api.spec import SpecError, parse_spec
from bidirkv.operator.crd.schema import build_crd, crd_yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_committed_crd_is_generated():
    committed = (ROOT / "crds" / "bidirkv.io_disaggregatedinferences.yaml").read_text()
    assert committed == crd_yaml(), "run `make crds` and commit the result"


def test_crd_reference_is_generated():
    page = (ROOT / crdref.PAGE).read_text()
    assert crdref.splice(page) == page, f"run `make crds` and commit {crdref.PAGE}"


def _nodes(node, path="openAPIV3Schema"):
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _nodes(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _nodes(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural_and_documented():
    root = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _nodes(root):
        assert not {"$ref", "anyOf", "oneOf", "allOf", "title", "nullable"} & set(node), path
        assert ("type" in node or node.get("x-kubernetes-int-or-string")), path
        if path.startswith("openAPIV3Schema.spec.") and not path.endswith(("{}", "[]")):
            assert node.get("description"), f"{path} has no description (kubectl explain)"


def test_scale_and_printer_columns():
    version = build_crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.decode.replicas",
        "statusReplicasPath": ".status.decode.replicas",
        "labelSelectorPath": ".status.decode.selector",
    }
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names == ["Model", "Prefill", "Decode", "Draining", "Bidirectional", "Phase",
                     "Age"]
    assert build_crd()["spec"]["names"]["shortNames"] == ["di"]


def test_example_parses(example):
    spec = parse_spec(example["spec"])
    assert spec.kv_transfer.decoder_kv_blocks_ttl_seconds == 480
    assert spec.decode.replicas == 2 and spec.prefill.tensor_parallel_size == 8


def test_bad_yaml_fields_are_named(minimal):
    minimal["spec"]["decode"] = {"replicas": "two"}
    with pytest.raises(SpecError, match=r"spec.decode.replicas: 'two': Input should be"):
        parse_spec(minimal["spec"])


def test_crd_file_is_valid_yaml_with_one_document():
    docs = list(yaml.safe_load_all(
        (ROOT / "crds" / "bidirkv.io_disaggregatedinferences.yaml").read_text()))
    assert len(docs) == 1 and docs[0]["kind"] == "CustomResourceDefinition"


# The CRD (what the API server enforces) and the pydantic models (what the operator and
# the local stack enforce) must agree on what is valid and on every default.
GOOD_SPECS = [
    {"model": {"name": "m"}},
    {"model": {"name": "m", "dtype": "float32", "maxModelLen": 4096},
     "decode": {"replicas": 3, "enablePrefixCaching": False},
     "kvTransfer": {"bidirectional": False, "decoderKvBlocksTtlSeconds": 60,
                    "retentionWatermark": 0.25, "ownerLeaseSeconds": 60},
     "router": {"conversationTtlSeconds": 50, "serviceType": "LoadBalancer", "replicas": 3,
                "handleStore": {"url": "rediss://valkey.cache:6379/2",
                                "passwordSecretRef": {"name": "valkey", "key": "pw"}}},
     "networkPolicy": {"metricsFrom": [{"namespaceSelector": {}}],
                       "routerFrom": [{"podSelector": {"matchLabels": {"a": "b"}}}]}},
    {"model": {"name": "m"}, "efa": {"enabled": True, "hugepages2Mi": "5Gi"},
     "kvTransfer": {"backend": "LIBFABRIC"},
     "prefill": {"efaDevices": 2, "resources": {"requests": {"memory": "1Gi"}}},
     "decode": {"efaDevices": 8, "resources": {"requests": {"cpu": 4}},
                "tolerations": [{"key": "gpu", "operator": "Exists"}]}},
    # A gateway sets the tenant header, and only the gateway reaches the router.
    {"model": {"name": "m"}, "router": {"trustedTenantHeader": "X-Tenant"},
     "networkPolicy": {"routerFrom": [{"namespaceSelector": {
         "matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}]}},
    # An optional object inside an optional object stays absent (no `{}` default that
    # would then miss its required fields).
    {"model": {"name": "m"}, "router": {"handleStore": {"url": "redis://v:6379/0"}}},
    {"model": {"name": "m"},
     "engine": {"modelCache": {"hostPath": {"path": "/nvme"}},
                "extraEnv": [{"name": "HF_TOKEN",
                              "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}],
                "imagePullSecrets": [{"name": "ecr"}], "podLabels": {"team": "ml"},
                "extraVolumes": [{"name": "x", "emptyDir": {"medium": "Memory"}}],
                "extraVolumeMounts": [{"name": "x", "mountPath": "/x"}]},
     "decode": {"modelCache": {"emptyDir": {"sizeLimit": "1e11"}},
                "resources": {"requests": {"memory": ".5Gi", "cpu": "+1"}}}},
]
BAD_SPECS = [
    {"model": {"name": "m"}, "engine": {"modelCache": {"hostPath": {"path": "/a"},
                                                       "emptyDir": {}}}},
    {"model": {"name": "m"}, "decode": {"modelCache": {"mountPath": "/m"}}},
    {"model": {"name": "m"}, "engine": {"modelCache": {"emptyDir": {"sizeLimit": "1K"}}}},
    {"model": {"name": "m"}, "prefill": {"resources": {"requests": {"cpu": "1_000"}}}},
    {},
    {"model": {"name": ""}},
    {"model": {"name": "m", "dtype": "fp8"}},
    {"model": {"name": "m"}, "prefill": {"replicas": 0}},
    {"model": {"name": "m"}, "decode": {"tensorParallelSize": 65}},
    {"model": {"name": "m"}, "kvTransfer": {"kvRecomputeThreshold": -1}},
    {"model": {"name": "m"}, "kvTransfer": {"backend": "TCP"}},
    {"model": {"name": "m"}, "kvTransfer": {"sideChannelPort": 80}},
    {"model": {"name": "m"}, "router": {"conversationTtlSeconds": 471}},
    {"model": {"name": "m"}, "kvTransfer": {"decoderKvBlocksTtlSeconds": 100}},
    {"model": {"name": "m"}, "efa": {"enabled": True}, "kvTransfer": {"backend": "LIBFABRIC"}},
    {"model": {"name": "m"}, "efa": {"enabled": True}, "prefill": {"efaDevices": 1},
     "decode": {"efaDevices": 1}},
    {"model": {"name": "m"}, "decode": {"efaDevices": 1}},
    {"model": {"name": "m"}, "router": {"serviceType": "ExternalName"}},
    {"model": {"name": "m"}, "networkPolicy": {"metricsFrom": [{}]}},
    # A tenant header believed from anyone who reaches the router (CEL rules).
    {"model": {"name": "m"}, "router": {"trustedTenantHeader": "X-Tenant"}},
    {"model": {"name": "m"}, "router": {"trustedTenantHeader": "X-Tenant"},
     "networkPolicy": {"enabled": False, "routerFrom": [{"podSelector": {}}]}},
    {"model": {"name": "m"}, "router": {"trustedTenantHeader": "X-Tenant"},
     "networkPolicy": {"routerFrom": [{"namespaceSelector": {}}]}},
    {"model": {"name": "m"}, "router": {"trustedTenantHeader": "X-Tenant",
                                        "serviceType": "LoadBalancer"},
     "networkPolicy": {"routerFrom": [{"podSelector": {"matchLabels": {"app": "gw"}}}]}},
    # Two routers without a shared store would split conversations (CEL rule).
    {"model": {"name": "m"}, "router": {"replicas": 2}},
    {"model": {"name": "m"}, "router": {"handleStore": {"url": "redis://u:pw@v:6379/0"}}},
    {"model": {"name": "m"}, "router": {"handleStore": {"url": "http://v:6379"}}},
    {"model": {"name": "m"}, "networkPolicy": {"routerFrom": [
        {"podSelector": {"matchExpressions": [{"key": "a", "operator": "Near"}]}}]}},
    {"model": {"name": "m"}, "kvTransfer": {"retentionWatermark": 0}},
    {"model": {"name": "m"}, "router": {"tenantRetentionShare": 0}},
    {"model": {"name": "m"}, "router": {"maxConversationsPerTenant": 0}},
    {"model": {"name": "m"}, "kvTransfer": {"retentionWatermark": 1.5}},
    {"model": {"name": "m"}, "kvTransfer": {"ownerLeaseSeconds": 5}},
    {"model": {"name": "m"}, "router": {"placement": {"policy": "always"}}},
    {"model": {"name": "m"}, "router": {"placement": {"maxLocalPrefillTokens": -1}}},
    {"model": {"name": "m"}, "router": {"placement": {"decodeBusyRequests": 0}}},
    # A threshold above the cap could never apply (CEL rule).
    {"model": {"name": "m"}, "router": {"placement": {"localPrefillTokens": 2048}}},
    # A lease past vLLM's TTL never matters (CEL rule).
    {"model": {"name": "m"}, "kvTransfer": {"decoderKvBlocksTtlSeconds": 60,
                                            "ownerLeaseSeconds": 61},
     "router": {"conversationTtlSeconds": 50}},
]


def _crd_validate(spec, name="x"):
    from kubeapi.crdschema import validate_custom_resource

    obj = {"apiVersion": "bidirkv.io/v1alpha1", "kind": "DisaggregatedInference",
           "metadata": {"name": name, "namespace": "default"}, "spec": spec}
    return validate_custom_resource(build_crd(), obj)


@pytest.mark.parametrize("spec", GOOD_SPECS)
def test_crd_and_models_accept_alike_with_equal_defaults(spec):
    obj, errors = _crd_validate(spec)
    assert [str(e) for e in errors] == []
    model = parse_spec(spec).model_dump(by_alias=True, mode="json", exclude_none=True)
    assert obj["spec"] == _drop_empty(model)


def _drop_empty(value):
    """The server does not default empty lists/maps the models carry as defaults."""
    if isinstance(value, dict):
        return {k: _drop_empty(v) for k, v in value.items() if v not in ([], {})}
    if isinstance(value, list):
        return [_drop_empty(v) for v in value]
    return value


@pytest.mark.parametrize("spec", BAD_SPECS)
def test_crd_and_models_refuse_alike(spec):
    _, errors = _crd_validate(spec)
    assert errors, f"CRD accepted {spec}"
    with pytest.raises(SpecError):
        parse_spec(spec)


def test_a_trusted_tenant_header_without_a_gateway_only_router_is_refused_by_name():
    spec = {"model": {"name": "m"}, "router": {"trustedTenantHeader": "X-Tenant"}}
    _, errors = _crd_validate(spec)
    assert any("router.trustedTenantHeader needs networkPolicy.enabled and a "
               "networkPolicy.routerFrom" in str(e) for e in errors), errors
    with pytest.raises(SpecError) as err:
        parse_spec(spec)
    said = str(err.value)
    assert "spec.router.trustedTenantHeader: 'X-Tenant'" in said
    assert "spec.networkPolicy.routerFrom is empty" in said
    assert "Set spec.networkPolicy.routerFrom to the gateway's pods alone" in said

    spec["router"]["serviceType"] = "LoadBalancer"
    spec["networkPolicy"] = {"routerFrom": [{"podSelector": {"matchLabels": {"app": "gw"}}}]}
    _, errors = _crd_validate(spec)
    assert [e for e in errors if "router.serviceType must be ClusterIP" in str(e)], errors
    with pytest.raises(SpecError, match=r"spec.router.serviceType: 'LoadBalancer' must be "
                       r"'ClusterIP' while spec.router.trustedTenantHeader is set"):
        parse_spec(spec)


def test_crd_refuses_a_long_name():
    _, errors = _crd_validate({"model": {"name": "m"}}, name="n" * 41)
    assert any("metadata.name must be at most 40 characters" in str(e) for e in errors)


def test_crd_rules_compile():
    from kubeapi.crdschema import validate_crd

    assert validate_crd(build_crd()) == []
