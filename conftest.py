import copy
import pathlib

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent


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
