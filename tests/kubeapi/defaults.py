"""What kube-apiserver 1.31-1.33 changes in the built-in objects the operator writes.

Three kinds of change, each one a way a naive "compare with what I wrote" goes wrong:
- defaults filled in (SetDefaults_* of apps/v1, core/v1, networking/v1);
- quantities canonicalised (see quantity.py);
- empty values dropped on the way out (Go's `omitempty`): empty lists, empty label and
  selector maps, an env var's empty `value`, a mount's `readOnly: false`.
Only the kinds and fields the operator writes are modelled.
"""

from __future__ import annotations

from typing import Any

from kubeapi.quantity import QuantityError, canonical

_PROBE_DEFAULTS = {"timeoutSeconds": 1, "periodSeconds": 10, "successThreshold": 1,
                   "failureThreshold": 3}
_EMPTY_MAP_KEYS = ("labels", "annotations", "nodeSelector", "matchLabels", "requests",
                   "limits", "data")


def _quantities(mapping: Any) -> None:
    if not isinstance(mapping, dict):
        return
    for key, value in mapping.items():
        try:
            mapping[key] = canonical(value)
        except QuantityError:
            pass  # validation (not modelled here) would refuse it


def _probe(probe: Any) -> None:
    if not isinstance(probe, dict):
        return
    for key, value in _PROBE_DEFAULTS.items():
        probe.setdefault(key, value)
    if isinstance(probe.get("httpGet"), dict):
        probe["httpGet"].setdefault("scheme", "HTTP")


def _image_pull_policy(image: str) -> str:
    name = image.rsplit("/", 1)[-1]
    tag = name.split(":", 1)[1] if ":" in name and "@" not in name else ""
    return "Always" if tag in ("", "latest") and "@" not in name else "IfNotPresent"


def _container(c: Any) -> None:
    if not isinstance(c, dict):
        return
    c.setdefault("terminationMessagePath", "/dev/termination-log")
    c.setdefault("terminationMessagePolicy", "File")
    c.setdefault("imagePullPolicy", _image_pull_policy(str(c.get("image", ""))))
    c.setdefault("resources", {})
    for key in ("requests", "limits"):
        _quantities(c["resources"].get(key))
    for port in c.get("ports") or []:
        if isinstance(port, dict):
            port.setdefault("protocol", "TCP")
    for key in ("startupProbe", "readinessProbe", "livenessProbe"):
        _probe(c.get(key))
    for env in c.get("env") or []:
        if not isinstance(env, dict):
            continue
        if env.get("value") == "":
            env.pop("value")
        field_ref = (env.get("valueFrom") or {}).get("fieldRef")
        if isinstance(field_ref, dict):
            field_ref.setdefault("apiVersion", "v1")
    for mount in c.get("volumeMounts") or []:
        if isinstance(mount, dict) and mount.get("readOnly") is False:
            mount.pop("readOnly")


def _volume(v: Any) -> None:
    if not isinstance(v, dict):
        return
    for source in ("configMap", "secret"):
        if isinstance(v.get(source), dict):
            v[source].setdefault("defaultMode", 420)
    if isinstance(v.get("hostPath"), dict):
        v["hostPath"].setdefault("type", "")
    empty = v.get("emptyDir")
    if isinstance(empty, dict) and "sizeLimit" in empty:
        _quantities(empty)


def _pod_template(template: Any) -> None:
    if not isinstance(template, dict):
        return
    template.setdefault("metadata", {}).setdefault("creationTimestamp", None)
    spec = template.setdefault("spec", {})
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("securityContext", {})
    spec.setdefault("schedulerName", "default-scheduler")
    for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        _container(c)
    for v in spec.get("volumes") or []:
        _volume(v)
    _quantities(spec.get("overhead"))


def _statefulset(spec: dict) -> None:
    spec.setdefault("podManagementPolicy", "OrderedReady")
    strategy = spec.setdefault("updateStrategy", {"type": "RollingUpdate"})
    if strategy.get("type") == "RollingUpdate":
        strategy.setdefault("rollingUpdate", {"partition": 0})
    spec.setdefault("revisionHistoryLimit", 10)
    spec.setdefault("persistentVolumeClaimRetentionPolicy",
                    {"whenDeleted": "Retain", "whenScaled": "Retain"})
    for claim in spec.get("volumeClaimTemplates") or []:
        resources = ((claim or {}).get("spec") or {}).get("resources") or {}
        for key in ("requests", "limits"):
            _quantities(resources.get(key))
    _pod_template(spec.get("template"))


def _deployment(spec: dict) -> None:
    strategy = spec.setdefault("strategy", {"type": "RollingUpdate"})
    if strategy.get("type") == "RollingUpdate":
        rolling = strategy.setdefault("rollingUpdate", {})
        rolling.setdefault("maxUnavailable", "25%")
        rolling.setdefault("maxSurge", "25%")
    spec.setdefault("revisionHistoryLimit", 10)
    spec.setdefault("progressDeadlineSeconds", 600)
    _pod_template(spec.get("template"))


def _network_policy(spec: dict) -> None:
    if "policyTypes" not in spec:
        spec["policyTypes"] = ["Ingress"] + (["Egress"] if spec.get("egress") else [])
    for rule in [*(spec.get("ingress") or []), *(spec.get("egress") or [])]:
        for port in (rule or {}).get("ports") or []:
            if isinstance(port, dict):
                port.setdefault("protocol", "TCP")


def _drop_empty(value: Any) -> Any:
    """Go's omitempty on output: empty lists everywhere, empty maps where the field is a map."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            v = _drop_empty(v)
            if v is None and k != "creationTimestamp":
                continue
            if v == [] or (v == {} and k in _EMPTY_MAP_KEYS):
                continue
            out[k] = v
        return out
    if isinstance(value, list):
        return [_drop_empty(v) for v in value]
    return value


_BY_KIND = {
    ("apps", "statefulsets"): _statefulset,
    ("apps", "deployments"): _deployment,
    ("networking.k8s.io", "networkpolicies"): _network_policy,
}
MODELLED = {*_BY_KIND, ("", "services"), ("", "configmaps"), ("", "secrets"),
            ("policy", "poddisruptionbudgets")}


def apply_defaults(key: tuple[str, str], obj: dict) -> None:
    """Change `obj` in place the way the API server would on create and update."""
    if key not in MODELLED:
        return
    spec = obj.get("spec")
    if isinstance(spec, dict) and key in _BY_KIND:
        _BY_KIND[key](spec)
    for field in ("spec", "data", "stringData"):
        if field in obj:
            obj[field] = _drop_empty(obj[field])
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        for field in ("labels", "annotations"):
            if meta.get(field) == {}:
                meta.pop(field)
