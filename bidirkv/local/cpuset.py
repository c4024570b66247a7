"""The cores the local stack's other processes run on: any but those decode binds.

Each engine's compute threads are bound to cores of their own (VLLM_CPU_OMP_THREADS_BIND)
and spin there while a step runs. A process left free (the router, an engine's API
server) is scheduled onto decode's core as readily as any other and then waits behind
decode's spinning threads for a time slice: on 2 cores with P on core 0 and D on core 1
that added several ms to every turn through the router (docs/local-stack.md, "Where the
router runs"). Keeping them off decode's cores removes that wait; prefill's cores are
fair game, since a turn that reaches the router while prefill computes waits for
prefill anyway.

Where decode's cores cannot be known (vLLM picks them: `auto`, or leaves threads free:
`nobind`) or nothing would be left, nothing is pinned and the reason is said.

Pure except `allowed_cores` and `pinned_thread`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from bidirkv.connector.settings import bind_cores

BIND_VAR = "VLLM_CPU_OMP_THREADS_BIND"
# vLLM's words for "the cores are not named here" and what each means for the choice.
UNNAMED = {
    "auto": "vLLM picks the cores when it starts",
    "all": "every core",
    "nobind": "its threads are not bound to any core",
    "": "vLLM picks the cores when it starts (auto)",
}


def format_cores(cores: Iterable[int]) -> str:
    """Sorted cores as a Linux CPU list: {0, 1, 2, 5} -> '0-2,5'."""
    out: list[str] = []
    run: list[int] = []
    for core in sorted(set(cores)):
        if run and core == run[-1] + 1:
            run.append(core)
            continue
        if run:
            out.append(_span(run))
        run = [core]
    if run:
        out.append(_span(run))
    return ",".join(out)


def _span(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


@dataclass(frozen=True)
class CpuChoice:
    """Where the processes that are not an engine's compute threads run."""
    cores: frozenset[int] | None  # None: left free
    decode: frozenset[int]  # the cores decode binds, as far as known
    why: str = ""  # why nothing is pinned

    def line(self, who: str = "router") -> str:
        if self.cores is not None:
            return (f"{who} on cores {format_cores(self.cores)} (decode binds "
                    f"{format_cores(self.decode)})")
        return f"{who} not pinned: {self.why}"


def choose_cores(decode_binds: Mapping[str, str | None],
                 available: Iterable[int] | None) -> CpuChoice:
    """The cores left once every decode engine's bound cores are taken out of `available`
    (the cores this process may run on; None: unknown). `decode_binds`: each decode
    engine's VLLM_CPU_OMP_THREADS_BIND (None: not set), by name."""
    decode: set[int] = set()
    for name, raw in sorted(decode_binds.items()):
        value = (raw or "").strip()
        if value.lower() in UNNAMED:
            said = f"is {value!r}" if value else "is not set"
            return CpuChoice(None, frozenset(decode), f"{name}'s {BIND_VAR} {said}: "
                             f"{UNNAMED[value.lower()]}")
        cores = bind_cores(value)
        if cores is None:
            return CpuChoice(None, frozenset(decode), f"{name}'s {BIND_VAR} {value!r} is "
                             "not a core list (e.g. '1', '0-3', '0,2', '0-3|4-7') nor "
                             f"one of {', '.join(repr(w) for w in UNNAMED if w)}")
        decode |= cores
    if not decode_binds:
        return CpuChoice(None, frozenset(), "the stack has no decode engine")
    if available is None:
        return CpuChoice(None, frozenset(decode), "the cores this machine lets it use "
                         "are unknown")
    allowed = frozenset(available)
    left = allowed - decode
    if not left:
        return CpuChoice(None, frozenset(decode), f"decode binds {format_cores(decode)}, "
                         f"every core it may use ({format_cores(allowed)})")
    if left == allowed:
        return CpuChoice(None, frozenset(decode), f"decode binds {format_cores(decode)}, "
                         f"none of the cores it may use ({format_cores(allowed)})")
    return CpuChoice(left, frozenset(decode))


def allowed_cores() -> frozenset[int] | None:
    """The cores this process may run on (Linux); None where that cannot be asked."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return frozenset(os.sched_getaffinity(0))


@contextlib.contextmanager
def pinned_thread(cores: frozenset[int] | None) -> Iterator[None]:
    """Run the block with the calling thread on `cores` (None: unchanged), then put its
    binding back. A process started inside inherits the binding from its first
    instruction on, before it can start threads of its own; other threads of this process
    keep theirs (pid 0 is the calling thread)."""
    if cores is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
