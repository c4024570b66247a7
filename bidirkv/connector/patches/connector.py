"""With the plugin on, every NIXL connector in the server is bidir-kv's.

vLLM's own NixlConnector would take `kv_transfer_params` on trust: a handle nobody signed
would be read, a read repeated after a failure, blocks kept for anyone who asks. So
`NixlBaseConnector.__init__` refuses any NIXL connector class but bidir-kv's (loaded with
`kv_connector_module_path`, bidirkv/connector/nixl/connector.py), and bidir-kv's refuses
to start where this guard is missing (the plugin is off, so the other global patches are
missing too).
"""

from __future__ import annotations

import functools

from bidirkv.connector.nixl.targets import CONNECTOR, MODULE_PATH, NAME
from bidirkv.connector.patches.guarded import wrap
from bidirkv.connector.targets import PatchSite

QUALNAME = "NixlBaseConnector.__init__"
TARGETS = [PatchSite(CONNECTOR, QUALNAME, ("self", "vllm_config", "role", "kv_cache_config"))]


class ForeignConnector(RuntimeError):
    """A NIXL connector that is not bidir-kv's, in a server with the plugin on."""


def _only_ours(orig):
    @functools.wraps(orig)
    def __init__(self, vllm_config, role, kv_cache_config):
        cls = type(self)
        if not cls.__module__.startswith("bidirkv."):
            raise ForeignConnector(
                f"bidir-kv: kv_connector {cls.__module__}.{cls.__qualname__} is vLLM's own "
                f"NIXL connector, which would reuse KV on trust; set kv_connector={NAME!r} "
                f"with kv_connector_module_path={MODULE_PATH!r} (or VLLM_PLUGINS without "
                "bidirkv to run vLLM without bidir-kv)")
        return orig(self, vllm_config, role, kv_cache_config)

    return __init__


def install() -> list[str]:
    wrap(CONNECTOR, QUALNAME, _only_ours)
    return ["bidir-kv-connector-only"]
