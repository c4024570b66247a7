"""Config file reloads: poll, and see through Kubernetes' ConfigMap symlink swap.

A mounted ConfigMap is `file -> ..data/file`, `..data -> ..2024_01_01_00_00_00.123`;
an update writes a new timestamped directory and swaps `..data` atomically, so the
file's own mtime may not move while the path now resolves elsewhere. The signature
therefore covers the resolved path and the target's inode, mtime and size.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bidirkv.router.config import ConfigError, RouterConfig, load_config

log = logging.getLogger("bidirkv.router")

Signature = tuple[str, int, int, int]


def file_signature(path: str | Path) -> Signature | None:
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    return real, st.st_ino, st.st_mtime_ns, st.st_size


class ConfigWatcher:
    """Calls `apply(config)` when the file changed and still validates; a bad file is
    logged and the running config kept."""

    def __init__(self, path: str | Path, overrides: dict[str, Any],
                 apply: Callable[[RouterConfig], None],
                 on_result: Callable[[str], None] | None = None, interval: float = 1.0) -> None:
        self.path = Path(path)
        self.overrides = overrides
        self.apply = apply
        self.on_result = on_result
        self.interval = interval
        self._sig = file_signature(self.path)
        self._missing_logged = False

    def poll(self) -> bool:
        """One check; True when a new config was applied."""
        sig = file_signature(self.path)
        if sig is None:
            if not self._missing_logged:
                log.warning("config file %s is missing; keeping the running config", self.path)
                self._missing_logged = True
            return False
        self._missing_logged = False
        if sig == self._sig:
            return False
        self._sig = sig
        try:
            cfg = load_config(self.path, self.overrides)
        except ConfigError as exc:
            log.error("config reload rejected, keeping the running config:\n%s", exc)
            self._result("rejected")
            return False
        self.apply(cfg)
        log.info("config reloaded from %s", self.path)
        self._result("applied")
        return True

    def _result(self, result: str) -> None:
        if self.on_result is not None:
            self.on_result(result)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - a reload bug must not stop the router
                log.exception("config reload failed")
                self._result("error")
