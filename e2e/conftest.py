"""The P/D stack the data-plane suites share: started once for e2e/test_connector.py and
e2e/test_observability.py (a start of both engines is most of what each would cost)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def traced(tmp_path_factory):
    from .vllm_stack import traced_stack

    with traced_stack(tmp_path_factory.mktemp("pd-stack")) as (stack, receiver):
        yield stack, receiver
