"""The P/D stack the data-plane suites share: started once for e2e/test_connector.py and
e2e/test_observability.py (a start of both engines is most of what each would cost).

Its users run one after the other, and the stack stops after the last of them: idle vLLM
servers still take a share of the 2 cores the later engine suites start their own
stacks on."""

from __future__ import annotations

import contextlib

import pytest

SHARED = "traced"
_stack = contextlib.ExitStack()
_last_user: list[str] = []


@pytest.fixture(scope="session")
def traced(tmp_path_factory):
    from .vllm_stack import traced_stack

    with _stack:
        yield _stack.enter_context(traced_stack(tmp_path_factory.mktemp("pd-stack")))


def pytest_collection_modifyitems(session, config, items):
    """The shared stack's users together, where the first of them was."""
    users = [i for i in items if SHARED in getattr(i, "fixturenames", ())]
    if not users:
        return
    first = items.index(users[0])
    rest = [i for i in items if SHARED not in getattr(i, "fixturenames", ())]
    items[:] = rest[:first] + users + rest[first:]
    _last_user[:] = [users[-1].nodeid]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if _last_user and item.nodeid == _last_user[0]:
        _stack.close()  # its servers stop now; the fixture's own exit finds nothing left
