"""vLLM 0.33, read from its wheel's source and never imported (no GPU, no CUDA torch):
every target the plugin patches or bidir-kv's connector classes override, with the
parameters they rely on, and the private attributes they read, are checked against it;
and what 0.33 changes in handles and streams is shown to be handled.

`make test` fetches the wheel (`pip download`, into .cache/vllm-next/); without it these
tests skip. docs/protocol.md (section 6) records what differs and what stays 0.32-only.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import sys
import zipfile

import pytest

from bidirkv.connector import plugin
from bidirkv.connector.core.handles import HANDLE_KEYS
from bidirkv.connector.patches import stream
from bidirkv.connector.targets import PatchSite, vllm_supported

ROOT = pathlib.Path(__file__).resolve().parent.parent
NEXT = "0.33.0"
WHEELS = sorted((ROOT / ".cache" / "vllm-next").glob(f"vllm-{NEXT}-*.whl"))
TARGETS = [*plugin.REQUIRED_TARGETS, *plugin.OPTIONAL_TARGETS, *plugin.CONNECTOR_TARGETS]
NIXL = "vllm/distributed/kv_transfer/kv_connector/v1/nixl"

# (file in the wheel, attribute): the private state the patches read or write, which no
# signature check would see change.
ATTRIBUTES = [
    (f"{NIXL}/base_scheduler.py", attr) for attr in (
        "_reqs_need_send", "_reqs_not_processed", "_reqs_in_batch", "_kv_lease_duration",
        "decoder_kv_blocks_ttl", "is_bidirectional_kv_xfer_enabled", "_is_hma_required",
        "block_size", "vllm_config", "kv_cache_config")
] + [
    (f"{NIXL}/base_worker.py", attr) for attr in (
        "_bidirectional_kv_xfer_enabled", "_remote_agents", "_invalid_remote_engines",
        "_recv_failures", "xfer_stats")
] + [
    (f"{NIXL}/connector.py", "connector_scheduler"),
    (f"{NIXL}/connector.py", "connector_worker"),
    ("vllm/v1/executor/multiproc_executor.py", "rpc_broadcast_mq"),
    ("vllm/distributed/device_communicators/shm_broadcast.py", "_spin_condition"),
    ("vllm/v1/engine/core.py", "input_queue"),
    ("vllm/v1/engine/core.py", "batch_queue"),
    ("vllm/v1/engine/core.py", "scheduler"),
    ("vllm/v1/core/sched/scheduler.py", "kv_holding_waiting"),
    ("vllm/v1/core/sched/scheduler.py", "finished_req_ids"),
    ("vllm/v1/core/sched/scheduler.py", "connector"),
    ("vllm/v1/core/sched/scheduler.py", "requests"),
]

pytestmark = pytest.mark.skipif(not WHEELS, reason=f"no vllm-{NEXT} wheel in .cache/vllm-next "
                                "(`make test` fetches it)")


class Source:
    """Python modules of one vLLM release, by file name, parsed on demand."""

    def __init__(self, read) -> None:  # noqa: ANN001 - a path -> text function
        self._read = read

    @functools.cache  # noqa: B019 - two instances, kept for the session
    def tree(self, path: str) -> ast.Module | None:
        text = self._read(path)
        return None if text is None else ast.parse(text)

    def module(self, dotted: str) -> tuple[str, ast.Module] | None:
        base = dotted.replace(".", "/")
        for path in (f"{base}.py", f"{base}/__init__.py"):
            if (tree := self.tree(path)) is not None:
                return path, tree
        return None

    def find(self, dotted: str, qualname: str, depth: int = 0) -> ast.AST | None:
        """The definition of `dotted:qualname`, through imports and base classes."""
        found = self.module(dotted)
        if found is None or depth > 8:
            return None
        _, tree = found
        head, *rest = qualname.split(".")
        node = _top_level(tree, head)
        if isinstance(node, ast.ImportFrom):
            return self.find(node.module, ".".join([head, *rest]), depth + 1) or (
                node if not rest else None)
        if node is None or not rest:
            return node
        if isinstance(node, ast.ClassDef):
            return self._member(dotted, tree, node, rest[0], depth)
        return None

    def _member(self, dotted: str, tree: ast.Module, cls: ast.ClassDef, name: str,
                depth: int) -> ast.AST | None:
        for item in cls.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == name:
                return item
            # A class attribute, e.g. a dataclass field the patches read.
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) \
                    and item.target.id == name:
                return item
            if isinstance(item, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == name for t in item.targets):
                return item
        for base in cls.bases:
            if not isinstance(base, ast.Name):
                continue
            imported = _top_level(tree, base.id)
            where = imported.module if isinstance(imported, ast.ImportFrom) else dotted
            if (hit := self.find(where, f"{base.id}.{name}", depth + 1)) is not None:
                return hit
        return None


def _top_level(tree: ast.Module, name: str) -> ast.AST | None:
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and (
                node.name == name):
            return node
        if isinstance(node, ast.ImportFrom) and any(
                (a.asname or a.name) == name for a in node.names):
            return node
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node
    return None


def _params(fn: ast.AST) -> tuple[str, ...]:
    """Parameter names as a caller sees them (a classmethod's `cls` is bound)."""
    args = fn.args
    names = tuple(a.arg for a in [*args.posonlyargs, *args.args])
    bound = any(isinstance(d, ast.Name) and d.id == "classmethod" for d in fn.decorator_list)
    return names[1:] if bound else names


@functools.cache
def next_release() -> Source:
    wheel = zipfile.ZipFile(WHEELS[-1])
    names = set(wheel.namelist())
    return Source(lambda p: wheel.read(p).decode() if p in names else None)


@functools.cache
def installed() -> Source:
    """The installed release (0.32), read as files: not imported either."""
    for entry in map(pathlib.Path, sys.path):
        if (entry / "vllm" / "__init__.py").is_file():
            return Source(lambda p, e=entry: (e / p).read_text() if (e / p).is_file() else None)
    pytest.skip("vLLM is not installed (`make engine`)")


def site_problem(src: Source, t: PatchSite) -> str | None:
    node = src.find(t.module, t.qualname)
    if node is None:
        return f"{t}: not found"
    if t.params is None:
        return None
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return f"{t}: not a function"
    names = _params(node)
    if names[: len(t.params)] != t.params:
        return f"{t}: parameters ({', '.join(names)}) are not ({', '.join(t.params)})"
    return None


def test_the_wheel_is_the_release_it_names():
    assert f"vllm-{NEXT}-" in WHEELS[-1].name
    assert next_release().module("vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector")


@pytest.mark.parametrize("target", TARGETS, ids=str)
def test_every_patch_target_is_there_with_its_parameters(target):
    assert site_problem(next_release(), target) is None


def test_the_reader_agrees_with_the_launcher_on_the_installed_release():
    """The same source reading passes on 0.32, whose targets the launcher checks live."""
    assert [p for t in TARGETS if (p := site_problem(installed(), t))] == []


def test_the_check_would_see_a_missing_target_and_a_changed_signature():
    src = next_release()
    assert "not found" in site_problem(src, PatchSite(TARGETS[0].module, "Nope.method"))
    t = next(t for t in TARGETS if t.params)
    assert "parameters" in site_problem(src, PatchSite(t.module, t.qualname, ("nope",)))


@pytest.mark.parametrize(("path", "attr"), ATTRIBUTES, ids=lambda v: str(v).rsplit("/", 1)[-1])
def test_the_private_state_the_patches_read_is_still_assigned(path, attr):
    tree = next_release().tree(path)
    assert tree is not None, path
    assigned = {node.attr for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)}
    assert attr in assigned, f"{path}: nothing assigns .{attr}"


def _pull_connector_init(src: Source) -> tuple[set[str], set[str]]:
    """(what NixlPullConnector.__init__ calls, what it assigns on self)."""
    fn = src.find(f"{NIXL.replace('/', '.')}.connector", "NixlPullConnector.__init__")
    calls = {n.func.id if isinstance(n.func, ast.Name) else n.func.attr
             for n in ast.walk(fn) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name | ast.Attribute)}
    stores = {n.attr for n in ast.walk(fn)
              if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
    return calls, stores


@pytest.mark.parametrize("release", ["installed", "next"])
def test_the_pull_connector_builds_only_its_scheduler_or_worker(release):
    """bidir-kv's NixlConnector.__init__ does what NixlPullConnector.__init__ does, with
    its own scheduler and worker (so no NIXL agent is built twice): that holds only while
    vLLM's does nothing else."""
    src = installed() if release == "installed" else next_release()
    calls, stores = _pull_connector_init(src)
    assert calls == {"super", "__init__", "NixlPullConnectorScheduler",
                     "NixlPullConnectorWorker"}
    assert stores == {"connector_scheduler", "connector_worker"}


def _returned_keys(src: Source) -> set[str]:
    """Keys of the handle dict that pull-mode `request_finished` returns."""
    fn = src.find(f"{NIXL.replace('/', '.')}.pull_scheduler",
                  "NixlPullConnectorScheduler.request_finished")
    return {kw.arg for node in ast.walk(fn) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name) and node.func.id == "dict"
            for kw in node.keywords if kw.arg}


def _stream_fields(src: Source, module: str, name: str) -> list[str]:
    """The fields a stream chunk model declares, in order."""
    found = src.module(module)
    cls = found and _top_level(found[1], name)
    return [n.target.id for n in (cls.body if cls else ())
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


def test_what_0_33_changes_in_handles_and_streams_is_handled():
    """0.33 adds `remote_registration_generation` to every handle (a P worker that sees a
    newer one drops its agent and handshakes again): it is signed with the rest. And 0.33
    streams `kv_transfer_params` itself on both stream models the stream patch checks, so
    the patch stands down there; the key comes after the chunk's first field, so the
    router takes the `null`s out as bytes."""
    new = _returned_keys(next_release()) - _returned_keys(installed())
    assert new == {"remote_registration_generation"}, new
    assert new <= set(HANDLE_KEYS)
    for where, name in stream.MODELS.values():
        assert stream.PARAMS not in _stream_fields(installed(), where, name), name
        fields = _stream_fields(next_release(), where, name)
        assert stream.PARAMS in fields and fields[0] != stream.PARAMS, (name, fields)
    assert vllm_supported(NEXT)
