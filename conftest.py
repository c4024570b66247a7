import copy
import pathlib
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent
# The test API server (tests/kubeapi) is test code, not part of the product package; the
# e2e suites and benchmarks import it as `kubeapi`.
sys.path.insert(0, str(ROOT / "tests"))
# Development tools (tools/), not in the package either.
sys.path.insert(0, str(ROOT / "tools"))


@pytest.fixture
def example() -> dict:
    return yaml.safe_load((ROOT / "examples" / "inference.yaml").read_text())


@pytest.fixture
def minimal() -> dict:
    return copy.deepcopy(
        {
            "apiVersion": "bidirkv.io/v1alpha1",
            "kind": "DisaggregatedInference",
            "metadata": {"name": "tiny", "namespace": "ns1", "uid": "u-1"},
            "spec": {"model": {"name": "facebook/opt-125m"}},
        }
    )


@pytest.fixture
def redis_url():
    """A real Redis-protocol server for this test (tests/redis_server.py), or a skip."""
    from redis_server import started

    server = started()
    yield server
    server.stop()
