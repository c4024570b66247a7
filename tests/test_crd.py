import pathlib

import pytest
import yaml

from bidirkv.operator import crdref
from bidirkv.operator.crd import build_crd, crd_yaml
from bidirkv.operator.spec import SpecError, parse_spec

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_committed_crd_is_generated():
    committed = (ROOT / "crds" / "bidirkv.io_disaggregatedinferences.yaml").read_text()
    assert committed == crd_yaml(), "run `make crds` and commit the result"


def test_readme_reference_is_generated():
    readme = (ROOT / "README.md").read_text()
    assert crdref.splice(readme) == readme, "run `make crds` and commit the README"


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
    assert names == ["Model", "Prefill", "Decode", "Bidirectional", "Phase", "Age"]
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
