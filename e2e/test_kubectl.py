"""The design card's commands with the real kubectl against the test API server.

kubectl is Debian's (package ``kubernetes-client``, which ``make test`` installs when no
kubectl is on the PATH): it validates on the client from the server's ``/openapi/v2``
(protobuf), prints ``get`` from the server's Table output (the CRD's printer columns), scales
through the ``scale`` subresource and explains fields from the OpenAPI document.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml

from kubeapi.server import running_kubeapi
from kubeapi.table import human_duration, table, table_version

ROOT = Path(__file__).resolve().parent.parent
CRD = ROOT / "crds" / "bidirkv.io_disaggregatedinferences.yaml"
EXAMPLE = ROOT / "examples" / "inference.yaml"
DI = ("bidirkv.io/v1alpha1", "disaggregatedinferences")
NAME = "qwen3-32b"

KUBECTL = shutil.which("kubectl")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The server with the CRD and the example applied by kubectl, and a kubectl runner."""
    if KUBECTL is None:
        if os.geteuid() != 0:
            pytest.skip("kubectl is not installed and this user cannot install it: "
                        "`make test` as root installs Debian's kubernetes-client")
        pytest.fail("kubectl is not installed: `make test` installs Debian's "
                    "kubernetes-client")
    home = tmp_path_factory.mktemp("kubectl-home")  # kubectl's discovery cache stays here
    with running_kubeapi() as server:
        env = {**os.environ, "HOME": str(home),
               "KUBECONFIG": str(server.write_kubeconfig(home / "kubeconfig"))}

        def kubectl(*args: str, check: bool = True) -> subprocess.CompletedProcess:
            done = subprocess.run([KUBECTL, *args], env=env, capture_output=True, text=True,
                                  timeout=60)
            if check and done.returncode:
                raise AssertionError(f"kubectl {' '.join(args)} failed ({done.returncode}): "
                                     f"{done.stderr}")
            return done

        kubectl("apply", "-f", str(CRD))
        applied = kubectl("apply", "-f", str(EXAMPLE))
        yield server, kubectl, applied


def _crd_schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _words(text: str) -> str:
    return " ".join(text.split())


def test_apply_example_with_validation(cluster):
    server, _, applied = cluster
    assert applied.stdout.strip() == f"disaggregatedinference.bidirkv.io/{NAME} created"
    stored = server.get(*DI, "default", NAME)
    example = yaml.safe_load(EXAMPLE.read_text())
    assert stored["spec"]["model"] == {**stored["spec"]["model"], **example["spec"]["model"]}
    assert stored["spec"]["kvTransfer"]["decoderKvBlocksTtlSeconds"] == 480
    assert stored["spec"]["decode"]["replicas"] == 2


@pytest.mark.parametrize(("field", "value", "error"), [
    ("bidirectionnal", True, 'unknown field "bidirectionnal"'),
    ("decoderKvBlocksTtlSeconds", "480s", 'got "string", expected "integer"'),
])
def test_invalid_field_refused_by_kubectl(cluster, tmp_path, field, value, error):
    server, kubectl, _ = cluster
    bad = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    bad["metadata"]["name"] = "bad"
    bad["spec"]["kvTransfer"][field] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    writes = len(server.writes())

    done = kubectl("apply", "-f", str(path), check=False)

    assert done.returncode != 0
    assert error in done.stderr
    assert "DisaggregatedInference.spec.kvTransfer" in done.stderr
    assert "error validating data" in done.stderr  # kubectl's own check, not the server's
    assert len(server.writes()) == writes
    assert server.get(*DI, "default", "bad") is None


def _set_status(server, status: dict) -> None:
    """What the operator would write (it does not run here)."""
    url = f"{server.url}/apis/{DI[0]}/namespaces/default/{DI[1]}/{NAME}/status"
    request = urllib.request.Request(
        url, data=json.dumps({"status": status}).encode(), method="PATCH",
        headers={"Content-Type": "application/merge-patch+json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


@pytest.mark.parametrize("resource", ["disaggregatedinference", "di"])
def test_get_prints_the_printer_columns(cluster, resource):
    server, kubectl, _ = cluster
    _set_status(server, {"phase": "Pending", "prefill": {"summary": "1/1"},
                         "decode": {"summary": "0/2", "draining": 1,
                                    "drainingSummary": "1 (3 held)"}})

    lines = kubectl("get", resource).stdout.splitlines()

    assert lines[0].split() == ["NAME", "MODEL", "PREFILL", "DECODE", "DRAINING",
                                "BIDIRECTIONAL", "PHASE", "AGE"]
    assert len(lines) == 2
    *row, age = lines[1].split()
    assert row == [NAME, "Qwen/Qwen3-32B", "1/1", "0/2", "1", "(3", "held)", "true",
                   "Pending"]
    # The draining decode pods and the conversations they still hold, in one column.
    assert lines[1][lines[0].index("DRAINING"):].startswith("1 (3 held) ")
    assert re.fullmatch(r"\d+s|\d+m(\d+s)?", age), age
    # Columns line up under their headers, as kubectl's table printer aligns them.
    assert lines[1].index("Qwen/Qwen3-32B") == lines[0].index("MODEL")


def test_explain_prints_the_field_descriptions(cluster):
    _, kubectl, _ = cluster
    out = kubectl("explain", "di.spec.kvTransfer").stdout
    transfer = _crd_schema()["properties"]["spec"]["properties"]["kvTransfer"]

    assert re.search(r"^KIND:\s+DisaggregatedInference$", out, re.M)
    assert re.search(r"^VERSION:\s+bidirkv.io/v1alpha1$", out, re.M)
    assert _words(transfer["description"]) in _words(out)
    for name, field in transfer["properties"].items():
        typed = "type" in field and not field.get("nullable")  # v2 keeps the type
        assert re.search(rf"^\s+{name}\s+<{field['type'] if typed else ''}", out, re.M), name
        assert _words(field["description"]) in _words(out), name


def test_server_side_dry_run_stores_nothing(cluster, tmp_path):
    server, kubectl, _ = cluster
    changed = yaml.safe_load(EXAMPLE.read_text())
    changed["spec"]["prefill"]["replicas"] = 4
    path = tmp_path / "changed.yaml"
    path.write_text(yaml.safe_dump(changed))
    before = server.get(*DI, "default", NAME)

    done = kubectl("apply", "--dry-run=server", "-f", str(path))

    assert done.stdout.strip() == (
        f"disaggregatedinference.bidirkv.io/{NAME} configured (server dry run)")
    assert server.get(*DI, "default", NAME) == before


def test_scale_sets_the_decode_replicas(cluster):
    server, kubectl, _ = cluster
    server.requests.clear()

    done = kubectl("scale", f"di/{NAME}", "--replicas=3")

    assert done.stdout.strip() == f"disaggregatedinference.bidirkv.io/{NAME} scaled"
    assert server.get(*DI, "default", NAME)["spec"]["decode"]["replicas"] == 3
    assert [(r.verb, r.subresource) for r in server.writes()] in (
        [("patch", "scale")], [("update", "scale")])


# What the commands above rely on, without kubectl.

KUBECTL_ACCEPT = ("application/json;as=Table;v=v1;g=meta.k8s.io,"
                  "application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json")


@pytest.mark.parametrize(("accept", "version"), [
    (KUBECTL_ACCEPT, "v1"),
    ("application/json;as=Table;v=v1beta1;g=meta.k8s.io, application/json", "v1beta1"),
    ("application/json", None),
    ("", None),
    ("application/json;as=PartialObjectMetadataList;v=v1;g=meta.k8s.io,application/json",
     None),
    ("application/vnd.kubernetes.protobuf;as=Table;v=v1;g=meta.k8s.io,"
     "application/json;as=Table;v=v1beta1;g=meta.k8s.io", "v1beta1"),
    ("application/json;as=Table;v=v2;g=meta.k8s.io,application/json", None),
])
def test_table_negotiation(accept, version):
    assert table_version(accept) == version


@pytest.mark.parametrize(("seconds", "text"), [
    (-3, "<invalid>"), (-1, "0s"), (0, "0s"), (119, "119s"), (120, "2m"), (125, "2m5s"),
    (599, "9m59s"), (600, "10m"), (3 * 3600 - 1, "179m"), (3 * 3600, "3h"),
    (3 * 3600 + 300, "3h5m"), (8 * 3600 + 300, "8h"), (47 * 3600, "47h"), (48 * 3600, "2d"),
    (50 * 3600, "2d2h"), (8 * 86400, "8d"), (2 * 365 * 86400, "2y"),
    (2 * 365 * 86400 + 86400, "2y1d"), (9 * 365 * 86400, "9y"),
])
def test_age_as_kubernetes_prints_it(seconds, text):
    assert human_duration(seconds) == text


def test_printer_cells_typed_like_the_api_server():
    import datetime as dt

    now = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
    columns = [{"name": n, "type": t, "jsonPath": p} for n, t, p in [
        ("Str", "string", ".spec.n"), ("Int", "integer", ".spec.n"),
        ("Bool", "boolean", ".spec.n"), ("Missing", "string", ".status.x"),
        ("First", "string", ".spec.list[0].name"), ("Key", "string", ".metadata.labels['a.b']"),
        ("Age", "date", ".metadata.creationTimestamp")]]
    obj = {"metadata": {"name": "x", "creationTimestamp": "2026-01-01T11:57:55Z",
                        "labels": {"a.b": "c"}},
           "spec": {"n": 3, "list": [{"name": "first"}]}}

    out = table([obj], columns, version="v1", include_object=None, metadata={}, now=now)

    assert [c["name"] for c in out["columnDefinitions"]] == ["Name"] + [c["name"]
                                                                       for c in columns]
    assert out["rows"][0]["cells"] == ["x", "3", 3, None, None, "first", "c", "2m5s"]
    assert out["rows"][0]["object"]["kind"] == "PartialObjectMetadata"
    assert "object" not in table([obj], [], version="v1", include_object="None", metadata={},
                                 now=now)["rows"][0]
