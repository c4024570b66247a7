"""Plugin registration, guarded patching and the CPU/idle wrappers, without vLLM."""

import os
import queue
import sys
import textwrap
import time
from types import ModuleType, SimpleNamespace

import pytest

from bidirkv.connector import plugin
from bidirkv.connector.core.residency import Residency
from bidirkv.connector.hooks.affinity import kept_affinity
from bidirkv.connector.launcher import plugin_error
from bidirkv.connector.patches import cpu as patch_cpu
from bidirkv.connector.patches import idle as patch_idle
from bidirkv.connector.patches.guarded import unwrap, when_imported, wrap
from bidirkv.connector.settings import Settings
from bidirkv.connector.targets import MARK, PatchSite, Skip, vllm_supported


def test_version_guard():
    assert vllm_supported("0.32.0") and vllm_supported("0.32.1") and vllm_supported("0.33.0")
    assert not vllm_supported("0.34.0") and not vllm_supported("0.3.2")


def test_no_stream_patch_where_vllm_streams_the_params_itself(monkeypatch):
    """vLLM 0.33's stream chunk model declares kv_transfer_params: nothing is wrapped."""
    from bidirkv.connector.patches import stream

    serving, protocol = ModuleType("bidirkv_fake_serving"), ModuleType("bidirkv_fake_proto")

    class Serving:
        async def chat_completion_stream_generator(self, request, result_generator,
                                                   request_id, model_name):
            yield "data: [DONE]\n\n"

    orig = Serving.chat_completion_stream_generator
    serving.OpenAIServingChat = Serving
    protocol.ChatCompletionStreamResponse = type("M", (), {"model_fields": {
        "id": None, "kv_transfer_params": None}})
    monkeypatch.setitem(sys.modules, serving.__name__, serving)
    monkeypatch.setitem(sys.modules, protocol.__name__, protocol)
    monkeypatch.setitem(stream.TARGETS, serving.__name__,
                        ("OpenAIServingChat.chat_completion_stream_generator", "chat"))
    monkeypatch.setitem(stream.MODELS, serving.__name__,
                        (protocol.__name__, "ChatCompletionStreamResponse"))
    assert stream.streams_params_itself(serving.__name__)
    assert stream.install(serving.__name__) == []
    assert Serving.chat_completion_stream_generator is orig
    # vLLM 0.32's model has no such field: the generator is wrapped.
    protocol.ChatCompletionStreamResponse.model_fields = {"id": None}
    assert stream.install(serving.__name__) == ["stream-params:OpenAIServingChat"]
    assert Serving.chat_completion_stream_generator is not orig


@pytest.fixture
def fake_module(tmp_path, monkeypatch):
    (tmp_path / "bidirkv_fake_target.py").write_text(textwrap.dedent("""
        class Engine:
            def step(self):
                return "orig"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "bidirkv_fake_target"
    sys.modules.pop("bidirkv_fake_target", None)


def test_patch_waits_for_the_module_and_applies_once(fake_module):
    def make(orig):
        def step(self):
            return "patched:" + orig(self)
        return step

    seen = []
    when_imported(fake_module, lambda: seen.append(wrap(fake_module, "Engine.step", make)))
    assert seen == [] and fake_module not in sys.modules
    mod = __import__(fake_module)
    assert seen == [True] and mod.Engine().step() == "patched:orig"
    assert getattr(mod.Engine.step, MARK)
    assert wrap(fake_module, "Engine.step", make) is False  # idempotent
    unwrap(fake_module, "Engine.step")
    assert mod.Engine().step() == "orig"
    with pytest.raises(Skip, match="not found"):
        wrap(fake_module, "Engine.gone", make)
    with pytest.raises(Skip, match="cannot import"):
        wrap("bidirkv_no_such_module", "X.y", make)


def test_register_refuses_an_unknown_vllm_and_a_missing_key(monkeypatch):
    """Fail closed: the server does not start rather than reuse KV on trust."""
    monkeypatch.setitem(sys.modules, "vllm", ModuleType("vllm"))
    sys.modules["vllm"].__version__ = "0.99.0"
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setenv("BIDIRKV_HANDLE_KEY", "k")
    with pytest.raises(plugin.PluginError, match="vLLM 0.99.0 is not a release"):
        plugin.register()
    assert plugin.applied == []
    sys.modules["vllm"].__version__ = "0.32.0"
    monkeypatch.delenv("BIDIRKV_HANDLE_KEY")
    monkeypatch.setattr(plugin, "_registered", False)
    with pytest.raises(plugin.PluginError, match="BIDIRKV_HANDLE_KEY is not set"):
        plugin.register()


def test_a_required_patch_that_cannot_apply_stops_the_process():
    def fails() -> list[str]:
        raise Skip("x.Y.z not found")

    with pytest.raises(plugin.PluginError, match="verified reuse patch cannot apply"):
        plugin._guarded("verified reuse", fails)()
    plugin._guarded("cpu", fails, required=False)()  # optional: skipped with a warning


def test_every_patch_target_resolves_in_the_installed_vllm():
    """Targets and parameters against the installed vLLM, without starting a server."""
    pytest.importorskip("vllm")
    from bidirkv.connector.targets import site_problems

    assert site_problems(plugin.REQUIRED_TARGETS + plugin.OPTIONAL_TARGETS
                           + plugin.CONNECTOR_TARGETS) == []


def test_launcher_sees_the_registered_entry_point():
    assert plugin_error({}) is None
    assert plugin_error({"VLLM_PLUGINS": "bidirkv,lora_filesystem_resolver"}) is None
    err = plugin_error({"VLLM_PLUGINS": "lora_filesystem_resolver"})
    assert err and "leaves out 'bidirkv'" in err


def test_agent_config_sets_the_progress_thread_unless_the_caller_does():
    def config(enable_prog_thread=True, num_threads=0):
        return enable_prog_thread, num_threads

    off = patch_cpu._agent_config(config, False)
    assert off(num_threads=4) == (False, 4)
    assert off(enable_prog_thread=True) == (True, 0)  # an explicit caller wins
    assert patch_cpu._agent_config(config, True)() == (True, 0)


def test_no_progress_thread_where_it_could_not_sleep(monkeypatch):
    pytest.importorskip("nixl")
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    def cannot(wait_us):
        raise Skip("no pthrDelay")

    monkeypatch.setattr(patch_cpu, "_install_sleeping_progress", cannot)
    try:
        applied = patch_cpu.install(Settings().resolve(is_cpu=True))
        assert "nixl-progress-thread=off" in applied
        assert base_worker.nixl_agent_config().enable_pthread is False
    finally:
        unwrap(patch_cpu.MODULE, "nixl_agent_config")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs sched_setaffinity and two cores")
def test_model_thread_keeps_its_cores():
    before = os.sched_getaffinity(0)
    last = max(before)

    def nixl_worker_init():  # what vLLM 0.32 does on the CPU platform
        os.sched_setaffinity(0, {last})

    try:
        with kept_affinity(Settings().resolve(True).keep_affinity):
            nixl_worker_init()
        assert os.sched_getaffinity(0) == before
        off = Settings.from_env({"BIDIRKV_CPU_KEEP_AFFINITY": "0"}).resolve(True)
        with kept_affinity(off.keep_affinity):
            nixl_worker_init()
        assert os.sched_getaffinity(0) == {last}
    finally:
        os.sched_setaffinity(0, before)


class FakeEngine:
    def __init__(self, unfinished=0, finished=(), dp=1):
        self.vllm_config = SimpleNamespace(
            parallel_config=SimpleNamespace(data_parallel_size=dp))
        self.scheduler = SimpleNamespace(
            get_num_unfinished_requests=lambda: unfinished, finished_req_ids=set(finished),
            connector=SimpleNamespace(has_pending_push_work=lambda: False), requests={})
        self.batch_queue = None
        self.input_queue = queue.Queue()
        self.handled = []

    def _handle_client_request(self, kind, req):
        self.handled.append((kind, req))


def test_idle_loop_waits_on_its_input_only_while_holding_blocks():
    step = patch_idle._process_engine_step(lambda self: False, 0.05)
    holding = FakeEngine()
    assert patch_idle.only_retained(holding)
    holding.input_queue.put(("ADD", "r1"))
    assert step(holding) is False and holding.handled == [("ADD", "r1")]
    for busy in (FakeEngine(unfinished=1), FakeEngine(finished={"r"}), FakeEngine(dp=2)):
        assert not patch_idle.only_retained(busy)
        busy.input_queue.put(("ADD", "r2"))
        step(busy)
        assert busy.handled == []  # the loop itself takes it, right away
    assert patch_idle._process_engine_step(lambda self: True, 5)(FakeEngine()) is True
    assert patch_idle.install(0) == []


class RecordingQueue(queue.Queue):
    def __init__(self):
        super().__init__()
        self.timeouts = []

    def get(self, block=True, timeout=None):
        self.timeouts.append(timeout)
        raise queue.Empty


def test_the_idle_poll_stays_short_while_a_peer_reads_its_blocks(monkeypatch):
    res = Residency()
    monkeypatch.setattr(patch_idle, "current", lambda: res)
    step = patch_idle._process_engine_step(lambda self: False, 0.02)
    engine = FakeEngine()
    engine.input_queue = RecordingQueue()
    # P: a finished prefill's blocks, which D reads right after P answered.
    engine.scheduler.requests = {"p1": SimpleNamespace(arrival_time=time.time())}
    assert patch_idle.peer_transfer_pending(engine)
    # Nobody came to read them: vLLM's lease frees them, the long poll is enough.
    later = time.time() + patch_idle.PEER_WINDOW_S + 1
    assert not patch_idle.peer_transfer_pending(engine, now=later)
    # D: the same request parked for a later turn can wait minutes.
    res.retain("p1", 4, None, deadline=1e9)
    assert not patch_idle.peer_transfer_pending(engine)
    step(engine)
    # Granted to a reuse read: the read needs this engine to step.
    assert res.grant("p1")[:2] == (True, "granted")
    assert patch_idle.peer_transfer_pending(engine, now=later)  # however old the turn
    step(engine)
    assert engine.input_queue.timeouts == [0.02, patch_idle.PEER_POLL_S]


def test_worker_sleeps_after_an_empty_step_and_spins_after_a_real_one():
    cond = SimpleNamespace(busy_loop_s=1.0)  # vLLM 0.32: 1 s busy-wait after a message
    proc = SimpleNamespace(rpc_broadcast_mq=SimpleNamespace(_spin_condition=cond))
    calls = []
    rpc = patch_idle._execute_worker_rpc(lambda self, req: calls.append(req[0]))

    def step(n):
        return ("execute_model", (SimpleNamespace(total_num_scheduled_tokens=n),), {}, 0)

    rpc(proc, step(0))
    assert cond.busy_loop_s == 0.0
    rpc(proc, ("get_kv_connector_handshake_metadata", (), {}, 0))
    assert cond.busy_loop_s == 0.0  # other calls leave the mode alone
    rpc(proc, step(12))
    assert cond.busy_loop_s == 1.0
    assert calls == ["execute_model", "get_kv_connector_handshake_metadata", "execute_model"]
    assert patch_idle.install_worker(0) == []


def _second_notification_arrives(tmp_path) -> bool:
    """vLLM's own SpinCondition pair over a real ZMQ socket: the reader consumes one
    notification and the writer sends the next well within libzmq's ~1 ms, as an engine
    does when a request arrives right after an empty step."""
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/notify"
    writer = SpinCondition(False, ctx, address)
    reader = SpinCondition(True, ctx, address, busy_loop_s=0)
    try:
        deadline = time.monotonic() + 5
        while True:  # PUB/SUB: wait until the subscription has reached the writer
            writer.notify()
            if reader.local_notify_socket.poll(50):
                reader.local_notify_socket.recv()
                break
            assert time.monotonic() < deadline
        time.sleep(0.01)  # well apart: this one arrives either way
        writer.notify()
        assert reader.local_notify_socket.poll(1000)
        reader.local_notify_socket.recv()
        writer.notify()
        # A dropped notification never arrives; a slow one under a loaded machine may take
        # longer than a few hundred ms, so wait as long as for the one before.
        return bool(reader.local_notify_socket.poll(1000))
    finally:
        for sock in (writer.local_notify_socket, reader.local_notify_socket,
                     reader.read_cancel_socket, reader.write_cancel_socket):
            sock.close(linger=0)
        ctx.term()


def test_a_sleeping_worker_is_woken_by_every_message(tmp_path):
    # Without the patch the second notification is dropped and a worker that went to
    # sleep after an empty step slept for vLLM's 5 s recheck (seen as 5.1 s TTFTs).
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    assert patch_idle.install_notify(0) == []
    try:
        assert patch_idle.install_notify(20) == [f"notify-hwm={patch_idle.NOTIFY_HWM}"]
        assert getattr(SpinCondition.__init__, MARK, False)
        assert all(_second_notification_arrives(tmp_path) for _ in range(20))
    finally:
        unwrap(patch_idle.NOTIFY_MODULE, "SpinCondition.__init__")


def test_the_worker_keeps_its_busy_wait_where_notifications_may_be_lost(monkeypatch):
    monkeypatch.setattr(patch_idle, "NOTIFY_TARGET",
                        PatchSite(patch_idle.NOTIFY_MODULE, "SpinCondition.gone"))
    with pytest.raises(Skip, match="keeps vLLM's busy wait"):
        patch_idle.install_worker(20)


@pytest.mark.parametrize(("bind", "cores"), [
    ("0", {0}), ("1", {1}), ("0-3", {0, 1, 2, 3}), ("0,2|4-5", {0, 2, 4, 5}),
    ("auto", None), ("nobind", None), ("", None), ("0-x", None),
])
def test_the_engine_core_joins_the_cores_its_workers_are_bound_to(bind, cores):
    from bidirkv.connector.settings import bind_cores

    assert bind_cores(bind) == (frozenset(cores) if cores else None)
    env = {"VLLM_CPU_OMP_THREADS_BIND": bind}
    assert Settings.from_env(env).resolve(is_cpu=True).engine_core_cores == bind_cores(bind)
    assert Settings.from_env(env).resolve(is_cpu=False).engine_core_cores is None
    off = {**env, "BIDIRKV_CPU_PIN_ENGINE_CORE": "0"}
    assert Settings.from_env(off).resolve(is_cpu=True).engine_core_cores is None


def _idle_agent_cpu_s(name: str) -> float:
    """CPU this process spends over 1 s while a NIXL agent with its progress thread is
    idle (the thread runs in this process)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    agent = base_worker.NixlWrapper(name, base_worker.nixl_agent_config(
        enable_prog_thread=True, backends=["UCX"]))
    time.sleep(0.2)
    t0 = os.times()
    time.sleep(1.0)
    t1 = os.times()
    del agent
    return (t1.user + t1.system) - (t0.user + t0.system)


def test_nixl_progress_thread_sleeps_between_events():
    pytest.importorskip("nixl")
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    from bidirkv.connector.settings import CPU_PROGRESS_WAIT_US

    api = sys.modules[base_worker.NixlWrapper.__module__]
    base = api.nixlBind.nixlAgentConfig
    try:
        applied = patch_cpu.install(Settings.from_env({}).resolve(is_cpu=True))
        assert "nixl-progress-thread=sleeping" in applied
        cfg = api.nixlBind.nixlAgentConfig()
        cfg.pthrDelay = 0  # what NIXL's Python agent sets
        assert cfg.pthrDelay == CPU_PROGRESS_WAIT_US
        # NIXL's own setting would poll without a pause: about a core.
        assert _idle_agent_cpu_s("bidirkv-test-sleeping") < 0.2
    finally:
        api.nixlBind.nixlAgentConfig = base
        unwrap(patch_cpu.MODULE, "nixl_agent_config")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_the_pin_applies_before_the_executor_starts_its_workers():
    before = os.sched_getaffinity(0)
    one = {min(before)}
    seen = []
    try:
        init = patch_cpu._pin_engine_core(lambda self: seen.append(os.sched_getaffinity(0)),
                                          frozenset(one))
        init(None)
        assert seen == [one]
    finally:
        os.sched_setaffinity(0, before)
