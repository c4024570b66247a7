"""The `bidir-kv` command: one entry point, one subcommand per component.

Components import lazily so `bidir-kv router` does not load kopf and `bidir-kv render`
does not load aiohttp: each command needs only its component's extra (`EXTRA`), and one
whose extra is not installed stops on a line naming it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from bidirkv.extras import problem

# The extra of pyproject.toml each command's dependencies are in; tests/test_image_extras.py
# holds it to what the command imports, and each image to the commands it runs.
EXTRA = {
    "render": "operator",
    "crd": "operator",
    "operator": "operator",
    "router": "router",
    "serve": "engine",
    "local": "tools",
    "bench": "tools",
    "sizing": "operator",
}


def _render(args: argparse.Namespace) -> int:
    import yaml

    from bidirkv.operator.api.spec import SpecError
    from bidirkv.operator.render.children import render_resource
    from bidirkv.operator.render.netpol import namespace_error

    if args.operator_namespace is not None and (
            problem := namespace_error(args.operator_namespace)):
        print(f"bidir-kv render: --operator-namespace: {problem}", file=sys.stderr)
        return 2
    try:
        with (sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")) as fh:
            docs = [d for d in yaml.safe_load_all(fh) if d]
    except OSError as exc:
        print(f"bidir-kv render: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        return 2
    except yaml.YAMLError as exc:
        print(f"bidir-kv render: {args.file} is not valid YAML: {exc}", file=sys.stderr)
        return 2
    out = []
    for doc in docs:
        if doc.get("kind") != "DisaggregatedInference":
            print(f"bidir-kv render: skipping kind {doc.get('kind')!r} (only "
                  "DisaggregatedInference is rendered)", file=sys.stderr)
            continue
        try:
            out += render_resource(doc, operator_namespace=args.operator_namespace)
        except SpecError as exc:
            name = (doc.get("metadata") or {}).get("name", "?")
            print(f"bidir-kv render: {name}: {exc}", file=sys.stderr)
            return 1
    sys.stdout.write(yaml.safe_dump_all(out, sort_keys=False, width=120))
    return 0


def _crd(args: argparse.Namespace) -> int:
    from bidirkv.operator.crd.schema import crd_yaml

    if args.apply:
        return _crd_apply(args.kubeconfig)
    sys.stdout.write(crd_yaml())
    return 0


def _crd_apply(kubeconfig: str | None) -> int:
    from bidirkv.operator.crd.apply import apply_crd_cli

    return apply_crd_cli(kubeconfig)


def _operator(args: argparse.Namespace) -> int:
    from bidirkv.operator.main import run

    return run(args)


def _router(args: argparse.Namespace) -> int:
    from bidirkv.router.server.app import main as router_main

    return router_main(args.rest)


def _serve(args: argparse.Namespace) -> int:
    from bidirkv.connector.launcher import main as serve_main

    return serve_main(args.rest)


def _local(args: argparse.Namespace) -> int:
    from bidirkv.local.cli import run

    return run(args)


def _bench(args: argparse.Namespace) -> int:
    from bidirkv.bench.cli import run

    return run(args)


def _sizing(args: argparse.Namespace) -> int:
    from bidirkv.sizing import run

    return run(args)


def _add_arguments(parser: argparse.ArgumentParser, command: str, module: str,
                   running: str | None) -> None:
    """The arguments `module` declares for `command`. Only the command being run must
    import: the others' modules may lack their extra here, or be left out of this image,
    and `bidir-kv --help` still lists them."""
    if command != running:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError:
            parser.description = f"needs the '{EXTRA[command]}' extra, not installed here"
            return
    importlib.import_module(module).add_arguments(parser)


def build_parser(running: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bidir-kv",
        description="1PnD vLLM with bidirectional KV transfer: operator, router, connector.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("render", help="print every child manifest of a DisaggregatedInference")
    p.add_argument("-f", "--file", required=True, help="YAML file ('-' for stdin)")
    p.add_argument("--operator-namespace", default=None, metavar="NS",
                   help="the operator's namespace, whose operator pods the engines' "
                   "NetworkPolicy admits (the operator's POD_NAMESPACE); default: each "
                   "resource's own")
    p.set_defaults(func=_render)

    p = sub.add_parser("crd", help="print the CustomResourceDefinition, or apply it (--apply)")
    p.add_argument("--apply", action="store_true",
                   help="create or update the CRD in the cluster instead of printing it "
                   "(the chart's pre-install/pre-upgrade hook runs this)")
    p.add_argument("--kubeconfig", help="with --apply: kubeconfig file (default: in-cluster, "
                   "then KUBECONFIG / ~/.kube/config)")
    p.set_defaults(func=_crd)

    p = sub.add_parser("operator", help="run the operator")
    _add_arguments(p, "operator", "bidirkv.operator.main", running)
    p.set_defaults(func=_operator)

    p = sub.add_parser("router", help="run the KV-cache-aware router", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_router)

    p = sub.add_parser("serve", help="preflight checks, then the vLLM server of one role",
                       add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_serve)

    p = sub.add_parser("local", help="run a spec's servers and router as local processes")
    _add_arguments(p, "local", "bidirkv.local.cli", running)
    p.set_defaults(func=_local)

    p = sub.add_parser("bench", help="multi-turn TTFT benchmark against a router")
    _add_arguments(p, "bench", "bidirkv.bench.cli", running)
    p.set_defaults(func=_bench)

    p = sub.add_parser("sizing", help="how many conversations a decode replica keeps at a "
                       "context length")
    _add_arguments(p, "sizing", "bidirkv.sizing", running)
    p.set_defaults(func=_sizing)
    return parser


# These hand their whole argument list to their own parser (argparse's REMAINDER does
# not pass on a leading option such as --help).
PASSTHROUGH = {"router": _router, "serve": _serve}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    running = argv[0] if argv and argv[0] in EXTRA else None
    if running and (why := problem(running, EXTRA[running])):
        print(why, file=sys.stderr)
        return 2
    if running in PASSTHROUGH:
        return PASSTHROUGH[running](argparse.Namespace(rest=argv[1:]))
    args = build_parser(running).parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
