"""Stop an engine from spinning while it only holds finished requests' blocks.

Retained blocks keep `Scheduler.has_requests()` true, so `EngineCoreProc.run_busy_loop`
steps an empty batch every 1 ms: about one core per server for minutes after a
conversation's last turn. `_process_engine_step` is wrapped: after an empty step with
nothing running or waiting, the loop blocks on its input queue for up to
BIDIRKV_IDLE_POLL_MS (1 ms while a peer reads its blocks, `peer_transfer_pending`).

That alone moves the spin into the worker, which busy-waits 1 s after every message
(`SpinCondition`, vllm/distributed/device_communicators/shm_broadcast.py): after a step
that scheduled nothing, `WorkerProc._execute_worker_rpc` sleeps at once instead. That is
safe only if no notification is lost, and vLLM's writer loses a second one sent within
~1 ms (PUB `SNDHWM` 1): a sleeping worker then slept on for 5 s. `SpinCondition.__init__`
is wrapped so the engine core's writers queue their notifications (readers `CONFLATE`).
docs/protocol.md, section 5, has the rest.
"""

from __future__ import annotations

import functools
import queue
import time

from bidirkv.connector.core.residency import HELD, current
from bidirkv.connector.patches.guarded import wrap
from bidirkv.connector.targets import PatchSite, Skip, site_problem

MODULE = "vllm.v1.engine.core"
WORKER_MODULE = "vllm.v1.executor.multiproc_executor"
NOTIFY_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
# Notifications a writer may have in flight; libzmq's default. Each is one byte, and the
# reader's socket conflates them, so nothing piles up.
NOTIFY_HWM = 1000
# How often an engine steps while a peer's read of its blocks is under way (as vLLM's own
# loop does while it has requests).
PEER_POLL_S = 0.001
# A peer reads P's blocks right after P answered, so within this of the request's arrival
# for any prompt P prefills in well under it; a longer prefill (several seconds for 10k
# tokens on the CPU build) may wait up to one long poll more for its read, under 1 %.
PEER_WINDOW_S = 2.0


def only_retained(engine) -> bool:
    """Nothing to compute: the scheduler only holds blocks of finished requests."""
    sched = engine.scheduler
    connector = getattr(sched, "connector", None)
    # Data-parallel engines step in lockstep with their peers: their loop is not ours.
    return (
        engine.vllm_config.parallel_config.data_parallel_size == 1
        and sched.get_num_unfinished_requests() == 0
        and not getattr(sched, "finished_req_ids", None)
        and not getattr(engine, "batch_queue", None)
        and not getattr(engine, "engines_running", False)
        and not (connector is not None and connector.has_pending_push_work())
    )


def peer_transfer_pending(engine, now: float | None = None) -> bool:
    """Some finished request's blocks are about to be read or freed: P's blocks that D reads
    right after P answered, D's blocks granted to a reuse read, or blocks being released.

    Without NIXL's progress thread (patches/cpu.py) a transfer advances only when this
    engine steps: a 20 ms poll cost every P/D request up to 20 ms (P/D overhead at
    concurrency 1: +33 ms, +19 ms with a 1 ms poll). Only requests that arrived within
    PEER_WINDOW_S count: blocks nobody came to read, or parked for a later turn, wait for
    vLLM's lease with the long poll."""
    requests = engine.scheduler.requests
    res = current()
    parked = res.parked() if res is not None else 0
    if len(requests) <= parked:
        return False
    since = (time.time() if now is None else now) - PEER_WINDOW_S
    held = res.held if res is not None else {}
    for rid, req in requests.items():
        h = held.get(rid)
        if h is None:
            if getattr(req, "arrival_time", 0.0) >= since:
                return True
        elif h.state != HELD:
            return True  # granted to a read or being released: moments, not minutes
    return False


def _process_engine_step(orig, poll_s: float):
    @functools.wraps(orig)
    def _step(self):
        executed = orig(self)
        if executed or not only_retained(self):
            return executed
        wait = PEER_POLL_S if peer_transfer_pending(self) else poll_s
        try:
            req = self.input_queue.get(timeout=wait)
        except queue.Empty:
            return executed
        self._handle_client_request(*req)
        return executed

    return _step


def _execute_worker_rpc(orig):
    @functools.wraps(orig)
    def _rpc(self, rpc_request):
        orig(self, rpc_request)
        method, args = rpc_request[0], rpc_request[1]
        cond = getattr(getattr(self, "rpc_broadcast_mq", None), "_spin_condition", None)
        if method != "execute_model" or not args or not hasattr(cond, "busy_loop_s"):
            return
        default = cond.__dict__.setdefault("_bidirkv_busy_loop_s", cond.busy_loop_s)
        empty = getattr(args[0], "total_num_scheduled_tokens", None) == 0
        cond.busy_loop_s = 0.0 if empty else default

    return _rpc


def _spin_condition_init(orig):
    import zmq

    class KeepingPub(zmq.Socket):
        # vLLM sets SNDHWM 1 before it binds; the option must be in place by then (libzmq
        # gives a bound socket's later connections the options it had at bind time).
        def setsockopt(self, option, value):
            if option == zmq.SNDHWM:
                value = max(value, NOTIFY_HWM)
            return super().setsockopt(option, value)

    class WriterContext:
        def __init__(self, context):
            self._context = context

        def socket(self, kind, **kwargs):
            return self._context.socket(kind, socket_class=KeepingPub, **kwargs)

    @functools.wraps(orig)
    def _init(self, is_reader, context, *args, **kwargs):
        orig(self, is_reader, context if is_reader else WriterContext(context), *args,
             **kwargs)

    return _init


NOTIFY_TARGET = PatchSite(NOTIFY_MODULE, "SpinCondition.__init__",
                       ("self", "is_reader", "context", "notify_address"))
TARGETS = [PatchSite(MODULE, "EngineCoreProc._process_engine_step", ("self",)),
           PatchSite(WORKER_MODULE, "WorkerProc._execute_worker_rpc", ("self", "rpc_request")),
           NOTIFY_TARGET]


def install(poll_ms: int) -> list[str]:
    if poll_ms <= 0:
        return []
    wrap(MODULE, "EngineCoreProc._process_engine_step",
         lambda o: _process_engine_step(o, poll_ms / 1000))
    return [f"idle-poll={poll_ms}ms", *install_notify(poll_ms)]


def install_notify(poll_ms: int) -> list[str]:
    """With the engine loop (install): the engine-core process is where the queue to the
    workers is written. Workers' replies keep vLLM's setting: the engine core spins for
    them, and every notification sent wakes threads on a busy core."""
    if poll_ms <= 0:
        return []
    wrap(NOTIFY_MODULE, "SpinCondition.__init__", _spin_condition_init)
    return [f"notify-hwm={NOTIFY_HWM}"]


def install_worker(poll_ms: int) -> list[str]:
    """Only with the idle poll (it is what sends the empty steps), and only where the
    engine core's notifications cannot be lost (install_notify)."""
    if poll_ms <= 0:
        return []
    if (problem := site_problem(NOTIFY_TARGET)) is not None:
        raise Skip(f"the worker keeps vLLM's busy wait: {problem}")
    wrap(WORKER_MODULE, "WorkerProc._execute_worker_rpc", _execute_worker_rpc)
    return ["worker-sleeps-after-empty-step"]
