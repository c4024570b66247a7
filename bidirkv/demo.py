"""`make demo`: the control plane end to end, on this machine, in about ten seconds.

Starts the in-memory Kubernetes API server (real HTTP on 127.0.0.1), installs the CRD,
runs the real operator, applies examples/inference.yaml and shows what a user sees:
the rendered children, `kubectl get disaggregatedinference`, a scale of the decode
pool, a spec the CRD refuses and one only the operator can refuse.

The local vLLM data plane and the multi-turn TTFT benchmark join this command when the
engine stack lands (see the README's status section).
"""

from __future__ import annotations

import asyncio
import logging
import pathlib
import sys

import yaml

from bidirkv.operator import printer
from bidirkv.operator.kube import ApiError
from bidirkv.testing.operatorenv import (
    api_server,
    di_path,
    eventually,
    resource,
    running_operator,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "inference.yaml"


def step(text: str) -> None:
    print(f"\n==> {text}", flush=True)


async def _get(client, name="qwen3-32b"):
    return await client.get("DisaggregatedInference", "default", name)


async def demo() -> int:
    doc = yaml.safe_load(EXAMPLE.read_text())
    async with api_server() as (server, client):
        step(f"API server on {server.url}; CRD installed")
        async with running_operator(client) as controller:
            step(f"kubectl apply -f {EXAMPLE.relative_to(ROOT)}")
            await client.call("POST", di_path("default"), resource(doc))
            await eventually(lambda: _status(client), what="status")
            await controller.idle()
            for method, _, body in controller.client.sent:
                if method == "POST":
                    print(f"    created {body['kind']} {body['metadata']['name']}")
            step("kubectl get disaggregatedinference")
            print(printer.table([await _get(client)]))

            step("kubectl scale di/qwen3-32b --replicas=3   (decode pool)")
            await client.call("PATCH", di_path("default", "qwen3-32b", "scale"),
                              {"spec": {"replicas": 3}}, "application/merge-patch+json")
            await eventually(lambda: _decode_desired(client, 3), what="scale")
            await controller.idle()
            sts = await client.get("StatefulSet", "default", "qwen3-32b-decode")
            print(f"    StatefulSet qwen3-32b-decode replicas: {sts['spec']['replicas']}")
            print(printer.table([await _get(client)]))

            step("a spec the API server refuses (CEL rule): router TTL above decode TTL")
            bad = resource(doc)
            bad["metadata"]["name"] = "bad-ttl"
            bad["spec"]["router"]["conversationTtlSeconds"] = 600
            try:
                await client.call("POST", di_path("default"), bad)
                print("    unexpectedly accepted")
                return 1
            except ApiError as exc:
                print(f"    {exc.status} {exc.reason}: {exc.message}")

            step("a spec only the operator can refuse: --port in engine.extraArgs")
            await client.call("PATCH", di_path("default", "qwen3-32b"),
                              {"spec": {"engine": {"extraArgs": ["--port=9000"]}}},
                              "application/merge-patch+json")
            di = await eventually(lambda: _phase(client, "Invalid"), what="Invalid")
            cond = next(c for c in di["status"]["conditions"] if c["type"] == "Reconciled")
            print(f"    condition Reconciled={cond['status']} reason={cond['reason']}: "
                  f"{cond['message']}")
            print(printer.table([di]))
    step("done: every process and port this demo opened is closed")
    return 0


async def _status(client):
    di = await _get(client)
    return di if (di.get("status") or {}).get("conditions") else None


async def _decode_desired(client, n):
    di = await _get(client)
    return (di.get("status") or {}).get("decode", {}).get("desired") == n


async def _phase(client, phase):
    di = await _get(client)
    return di if (di.get("status") or {}).get("phase") == phase else None


def main() -> int:
    # kopf reports its own reconnects and retries at INFO/WARNING; the demo shows results.
    logging.basicConfig(level=logging.WARNING, format="    [%(name)s] %(message)s")
    logging.getLogger("kopf").setLevel(logging.CRITICAL)
    logging.getLogger("bidirkv.operator").setLevel(logging.ERROR)
    try:
        return asyncio.run(demo())
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
