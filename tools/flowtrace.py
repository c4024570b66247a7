"""Which router modules one returning turn enters, in the order it runs them.

Starts the in-process fake cluster of the router tests (tests/fake_engine.py), sends a first
turn, then records every new function frame of bidirkv/router/ that the second turn's request
handler task runs (background tasks such as health checks are left out). Prints how many times
the turn entered a module, how many of those went back to a module it had already left, and
the sequence, for the data path's modules alone and for all of the router's.

    .venv/bin/python tools/flowtrace.py [--no-stream] [--all]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ROUTER = str(ROOT / "bidirkv" / "router") + "/"
DATA_PATH = ("datapath/", "engine/", "tracing/")
FIRST = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def entries(modules: list[str]) -> list[str]:
    """The modules in order, a run of calls inside one module counted once."""
    out: list[str] = []
    for m in modules:
        if not out or out[-1] != m:
            out.append(m)
    return out


def returns(path: list[str]) -> int:
    seen: set[str] = set()
    back = 0
    for m in path:
        back += m in seen
        seen.add(m)
    return back


def report(label: str, path: list[str]) -> str:
    return (f"{label}: {len(path)} entries into {len(set(path))} modules, {returns(path)} back "
            f"into a module already left\n  " + " > ".join(path))


async def trace_turn(stream: bool) -> list[str]:
    sys.path.insert(0, str(ROOT / "tests"))
    from fake_engine import Cluster

    modules: list[str] = []
    frames: list[FrameType] = []  # kept alive, so that no id is reused while recording
    seen: set[int] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(ROUTER):
            return
        if id(frame) in seen:  # a coroutine resumed, not entered
            return
        task = asyncio.current_task()
        # aiohttp runs each request in a task of its own protocol's handler.
        if task is None or "RequestHandler" not in task.get_coro().__qualname__:
            return
        seen.add(id(frame))
        frames.append(frame)
        modules.append(frame.f_code.co_filename[len(ROUTER):])

    async with Cluster() as c:
        first = await c.chat(FIRST, stream, conversation_id="flow")
        second = FIRST + [first["message"], {"role": "user", "content": "more"}]
        sys.setprofile(profile)
        try:
            reply = await c.chat(second, stream, conversation_id="flow")
        finally:
            sys.setprofile(None)
        if reply["status"] != 200:
            raise SystemExit(f"the returning turn failed: HTTP {reply['status']}")
    return modules


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-stream", action="store_true", help="a turn that is not streamed")
    ap.add_argument("--all", action="store_true", help="also list every router module entered")
    args = ap.parse_args(argv)
    modules = asyncio.run(trace_turn(not args.no_stream))
    print(report("data path (bidirkv/router/datapath/, engine/, tracing/)",
                 entries([m for m in modules if m.startswith(DATA_PATH)])))
    if args.all:
        print(report("all of bidirkv/router/", entries(modules)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
