"""The engines' NetworkPolicy admits the operator's pods from the operator's namespace only:
the rendering (render/netpol.py), where the namespace comes from (operator/main.py) and
the operator that writes the policy."""

from __future__ import annotations

import asyncio

import kubernetes
import pytest

from bidirkv.cli import main as cli_main
from bidirkv.operator.main import NAMESPACE_ENV, operator_namespace, run_operator
from bidirkv.operator.reconcile.controller import Controller
from bidirkv.operator.render.children import render_resource
from bidirkv.operator.render.netpol import OPERATOR_POD_LABELS, namespace_error
from kubeapi.operatorenv import api_server, di_path, eventually, resource, running_operator
from kubeapi.schemas import KUBE_VERSIONS, schema_errors

OPERATOR_PODS = {"matchLabels": OPERATOR_POD_LABELS}


def engines_policy(objs: list[dict]) -> dict:
    (policy,) = [o for o in objs if o["kind"] == "NetworkPolicy"
                 and o["metadata"]["name"].endswith("-engines")]
    return policy


def http_peers(policy: dict) -> list[dict]:
    (rule,) = [r for r in policy["spec"]["ingress"] if r.get("ports")]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    return rule["from"]


def test_the_operator_is_admitted_from_its_namespace(minimal):
    policy = engines_policy(render_resource(minimal, operator_namespace="bidir-kv-system"))
    # One peer, both selectors: the operator's pods in that namespace (two peers would
    # admit the whole namespace, or the labelled pods anywhere).
    assert {"namespaceSelector": {"matchLabels": {
                "kubernetes.io/metadata.name": "bidir-kv-system"}},
            "podSelector": OPERATOR_PODS} in http_peers(policy)
    assert not any(p.get("namespaceSelector") == {} for p in http_peers(policy))
    for version in KUBE_VERSIONS:
        assert schema_errors(policy, version) == []


def test_without_its_namespace_the_operator_is_admitted_from_the_engines_own(minimal):
    """Run by hand the operator is not told its namespace: a podSelector alone, which
    matches the labelled pods of the policy's (the resource's) namespace only."""
    peers = http_peers(engines_policy(render_resource(minimal)))
    assert {"podSelector": OPERATOR_PODS} in peers
    assert not any("namespaceSelector" in p and p.get("podSelector") == OPERATOR_PODS
                   for p in peers)


@pytest.mark.parametrize("value", ["bidir-kv-system", "a", "0team-1", "a" * 63])
def test_namespace_names(value):
    assert namespace_error(value) is None


@pytest.mark.parametrize("value", ["", "Team", "team_a", "-team", "team-", "a.b", "a" * 64])
def test_bad_namespace_names(value):
    assert namespace_error(value) == (
        f"{value!r} is not a namespace name (up to 63 of a-z 0-9 -, starting and ending "
        "alphanumeric)")


def test_the_namespace_comes_from_the_environment():
    assert operator_namespace({NAMESPACE_ENV: "bidir-kv-system"}) == "bidir-kv-system"
    # Unset or empty: run by hand, nothing to fail on.
    assert operator_namespace({}) is None
    assert operator_namespace({NAMESPACE_ENV: ""}) is None
    with pytest.raises(ValueError, match=rf"^{NAMESPACE_ENV}: 'Kube_System' is not a namespace"):
        operator_namespace({NAMESPACE_ENV: "Kube_System"})


def test_a_bad_namespace_stops_the_operator_before_it_starts(monkeypatch, capsys):
    monkeypatch.setenv(NAMESPACE_ENV, "Kube_System")
    assert cli_main(["operator", "--kubeconfig", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert f"bidir-kv operator: {NAMESPACE_ENV}: 'Kube_System' is not a namespace name" in err
    with pytest.raises(ValueError, match="operator namespace: 'x_y' is not a namespace name"):
        Controller(None, operator_namespace="x_y")


def test_run_operator_refuses_a_controller_for_another_namespace():
    controller = Controller(None, operator_namespace="ops")
    with pytest.raises(ValueError, match="'bidir-kv-system' differs .* 'ops'"):
        asyncio.run(run_operator(kubernetes.client.Configuration(),
                                 operator_namespace="bidir-kv-system", controller=controller))


def test_render_cli_takes_the_operator_namespace(tmp_path, capsys, minimal):
    import yaml

    path = tmp_path / "di.yaml"
    path.write_text(yaml.safe_dump(minimal))
    assert cli_main(["render", "-f", str(path), "--operator-namespace", "ops"]) == 0
    policy = engines_policy(list(yaml.safe_load_all(capsys.readouterr().out)))
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
            "podSelector": OPERATOR_PODS} in http_peers(policy)
    assert cli_main(["render", "-f", str(path), "--operator-namespace", "Ops"]) == 2
    assert "--operator-namespace: 'Ops' is not a namespace name" in capsys.readouterr().err


async def test_the_operator_writes_the_policy_for_its_namespace(minimal):
    async with api_server() as (_, client), running_operator(
            client, operator_namespace="bidir-kv-system"):
        await client.call("POST", di_path("ns1"), resource(minimal, "ns1"))
        policy = await eventually(lambda: client.get("NetworkPolicy", "ns1", "tiny-engines"),
                                  what="the engines' NetworkPolicy")
    assert {"namespaceSelector": {"matchLabels": {
                "kubernetes.io/metadata.name": "bidir-kv-system"}},
            "podSelector": OPERATOR_PODS} in http_peers(policy)
