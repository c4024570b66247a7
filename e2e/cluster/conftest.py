"""The real-cluster suite runs only when KUBECONFIG names a cluster that answers."""

from __future__ import annotations

import functools
import os
import pathlib

import pytest


@functools.cache
def skip_reason() -> str | None:
    """Why this suite cannot run here, or None when it can."""
    path = os.environ.get("KUBECONFIG")
    if not path:
        return ("KUBECONFIG is not set: e2e/cluster needs a real cluster (kind or EKS) with "
                "the bidir-kv images; see docs/testing.md, 'Testing on a cluster'")
    if not pathlib.Path(path.split(os.pathsep)[0]).expanduser().is_file():
        return f"KUBECONFIG={path}: no such file"
    try:
        import helm_python  # noqa: F401
    except ImportError:
        return "helm-python-sdk is not installed (pip install -e '.[test]')"
    import kubernetes

    try:
        configuration = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=path,
                                           client_configuration=configuration)
        configuration.retries = False  # one try: an absent cluster must not cost minutes
        with kubernetes.client.ApiClient(configuration) as api:
            version = kubernetes.client.VersionApi(api).get_code(_request_timeout=(5, 10))
    except Exception as exc:  # noqa: BLE001 - any failure means: no cluster to test
        return f"KUBECONFIG={path}: the cluster does not answer ({exc.__class__.__name__}: {exc})"
    if (int(version.major), int(version.minor.rstrip("+"))) < (1, 31):
        return f"the cluster runs Kubernetes {version.git_version}; the chart needs >= 1.31"
    return None


@pytest.fixture(scope="session")
def kubeconfig() -> str:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    return os.environ["KUBECONFIG"].split(os.pathsep)[0]
