"""`bidir-kv local up|down|drain|restart`: the rendered stack as processes on this machine.

`up` returns once every server is healthy and leaves them running (each in its own
process group and session); `down` stops them, and whatever they started, by the pids,
groups and start times recorded in the state directory. `up` over a state directory
whose servers died first stops what they left running. `drain NAME` does to one engine
what deleting its pod does (bidirkv/local/drain.py); `restart NAME` then starts it again
with the same command, as a rollout does, and works for the router too
(bidirkv/local/restart.py).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

from bidirkv.local.cpu import DtypeChoice, choose_dtype, read_cpu
from bidirkv.local.state import DEFAULT_STATE_DIR

PROG = "bidir-kv local"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="local_command", required=True, metavar="ACTION")
    up = sub.add_parser("up", help="start prefill, decode(s) and the router; wait until healthy")
    up.add_argument("-f", "--file", required=True, help="a DisaggregatedInference YAML")
    up.add_argument("--state-dir", type=pathlib.Path, default=DEFAULT_STATE_DIR,
                    help=f"state file, logs, router config (default {DEFAULT_STATE_DIR})")
    up.add_argument("--port-base", type=int,
                    help="use consecutive ports from here (default: free ports)")
    up.add_argument("--tiny-model", action="store_true",
                    help="build the tiny test model at spec.model.name if it is missing")
    up.add_argument("--no-bidirectional", action="store_true",
                    help="kvTransfer.bidirectional false on every server and the router")
    up.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                    help="how long servers may take to become healthy")
    up.add_argument("--no-progress", action="store_true", help="no progress bar")
    down = sub.add_parser("down", help="stop the stack recorded in the state directory")
    down.add_argument("--state-dir", type=pathlib.Path, default=DEFAULT_STATE_DIR)
    drain = sub.add_parser("drain", help="SIGTERM one engine as a pod deletion does: it "
                           "drains what it holds, then stops; wait until it exited")
    drain.add_argument("name", help="the engine, as `up` lists it (e.g. decode-1)")
    drain.add_argument("--state-dir", type=pathlib.Path, default=DEFAULT_STATE_DIR)
    drain.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                       help="stop waiting after this long (the server keeps draining)")
    restart = sub.add_parser("restart", help="stop one server as a rollout does (an engine "
                             "drains first), then start it again with the same command")
    restart.add_argument("name", help="a server, as `up` lists it (e.g. decode-0, router)")
    restart.add_argument("--drop", action="store_true",
                         help="SIGKILL it and what it started instead (a crash: nothing drains)")
    restart.add_argument("--state-dir", type=pathlib.Path, default=DEFAULT_STATE_DIR)
    restart.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                         help="how long to wait for it to stop (it is not started again "
                         "while it still drains)")
    restart.add_argument("--start-timeout", type=float, default=None, metavar="SECONDS",
                         help="how long it may take to serve again")


def prepare_stack(spec_file: str | os.PathLike[str], state_dir: pathlib.Path, *,
                  patch: dict | None = None, port_base: int | None = None,
                  tiny_model: bool = False, cwd: str | os.PathLike[str] | None = None,
                  progress: bool = True):
    """Spec file -> LocalStack (not started): the steps `local up`, the demo and the e2e
    test share."""
    from bidirkv.local.cpuset import allowed_cores
    from bidirkv.local.plan import local_spec, merge_patch, plan_stack, ports_needed, read_spec_file
    from bidirkv.local.ports import free_ports, sequential_ports
    from bidirkv.local.stack import LocalStack

    cwd = pathlib.Path(cwd or os.getcwd())
    raw, choice = with_local_dtype(merge_patch(read_spec_file(spec_file), patch or {}))
    if tiny_model:
        build_tiny_model(pathlib.Path(cwd, raw.get("model", {}).get("name", "")),
                         choice.dtype, progress)
    spec = local_spec(raw, cwd)
    n = len(ports_needed(spec))
    ports = sequential_ports(port_base, n) if port_base is not None else free_ports(n)
    state_dir = pathlib.Path(state_dir).resolve()
    stack = LocalStack(plan_stack(spec, ports, state_dir, available_cores=allowed_cores()),
                       state_dir, str(spec_file))
    stack.dtype_choice = choice
    stack.spec = spec
    return stack


def with_local_dtype(raw: dict) -> tuple[dict, DtypeChoice]:
    """The spec dict with `model.dtype: auto` replaced by the dtype this CPU runs fast
    (cpu.py), and the choice with its reason; an explicit dtype is kept."""
    from bidirkv.local.plan import merge_patch

    model = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    choice = choose_dtype(str(model.get("dtype", "auto")), read_cpu())
    if choice.picked:
        raw = merge_patch(raw, {"model": {"dtype": choice.dtype}})
    return raw, choice


def tiny_model_for(spec_file: str | os.PathLike[str], cwd: str | os.PathLike[str],
                   progress: bool = True) -> tuple[pathlib.Path, DtypeChoice]:
    """Build (or find) the tiny model at the spec's model path, in the dtype the local
    stack will run it in."""
    from bidirkv.local.plan import read_spec_file

    raw, choice = with_local_dtype(read_spec_file(spec_file))
    path = pathlib.Path(cwd, raw["model"]["name"])
    return build_tiny_model(path, choice.dtype, progress), choice


def build_tiny_model(path: pathlib.Path, dtype: str, progress: bool = True) -> pathlib.Path:
    """Build (or find, by its stamp) the tiny model, with a progress bar."""
    from tqdm import tqdm

    from bidirkv.local.model import build_model

    with tqdm(total=1, desc=f"tiny model ({dtype})", unit="model", disable=not progress,
              file=sys.stderr) as bar:
        out = build_model(path, dtype=dtype)
        bar.update(1)
    return out


def _up(args: argparse.Namespace) -> int:
    from bidirkv.local.ports import PortInUse
    from bidirkv.local.stack import DEFAULT_START_TIMEOUT, StackRunning, StartError

    patch = {"kvTransfer": {"bidirectional": False}} if args.no_bidirectional else None
    try:
        stack = prepare_stack(args.file, args.state_dir, patch=patch, port_base=args.port_base,
                              tiny_model=args.tiny_model, progress=not args.no_progress)
        print(f"{PROG} up: {read_cpu().describe()}; {stack.dtype_choice.line()}",
              file=sys.stderr)
        print(f"{PROG} up: {stack.cpu_line()}", file=sys.stderr)
        try:
            stack.start(timeout=args.timeout or DEFAULT_START_TIMEOUT,
                        progress=not args.no_progress)
        finally:
            for line in stack.cleaned:
                print(f"{PROG} up: previous stack: {line}", file=sys.stderr)
    except (ValueError, PortInUse, StackRunning) as exc:
        print(f"{PROG} up: {exc}", file=sys.stderr)
        return 1
    except StartError as exc:
        print(f"{PROG} up: {exc}", file=sys.stderr)
        print(f"{PROG} up: stopped every server it had started", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG} up: interrupted; stopped every server it had started", file=sys.stderr)
        return 130
    for rec in stack.state.procs:
        print(f"{rec.name:10s} {rec.url}  pid {rec.pid}  log {rec.log}", file=sys.stderr)
    print(f"state: {stack.state_dir / 'stack.json'}; stop with `bidir-kv local down "
          f"--state-dir {args.state_dir}`", file=sys.stderr)
    print(stack.router_url)
    return 0


def _down(args: argparse.Namespace) -> int:
    from bidirkv.local.stack import stop_recorded

    try:
        done = stop_recorded(args.state_dir)
    except ValueError as exc:
        print(f"{PROG} down: {exc}", file=sys.stderr)
        return 1
    if not done:
        print(f"{PROG} down: no stack recorded in {args.state_dir}", file=sys.stderr)
        return 0
    for line in done:
        print(line)
    return 0


def _drain(args: argparse.Namespace) -> int:
    from bidirkv.local.drain import DEFAULT_WAIT_S, drain_server

    try:
        done = drain_server(args.state_dir, args.name, args.timeout or DEFAULT_WAIT_S,
                            say=lambda line: print(f"{PROG} drain: {line}", file=sys.stderr))
    except ValueError as exc:
        print(f"{PROG} drain: {exc}", file=sys.stderr)
        return 1
    return 0 if done else 1


def _restart(args: argparse.Namespace) -> int:
    from bidirkv.local.drain import DEFAULT_WAIT_S
    from bidirkv.local.restart import DEFAULT_START_S, restart_server
    from bidirkv.local.stack import StartError

    try:
        done = restart_server(args.state_dir, args.name, drop=args.drop,
                              wait_s=args.timeout or DEFAULT_WAIT_S,
                              start_timeout=args.start_timeout or DEFAULT_START_S,
                              say=lambda line: print(f"{PROG} restart: {line}", file=sys.stderr))
    except (ValueError, StartError) as exc:
        print(f"{PROG} restart: {exc}", file=sys.stderr)
        return 1
    return 0 if done.record is not None else 1


def run(args: argparse.Namespace) -> int:
    return {"up": _up, "down": _down, "drain": _drain,
            "restart": _restart}[args.local_command](args)
