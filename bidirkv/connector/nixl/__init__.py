"""bidir-kv's NIXL connector: the classes vLLM loads through `kv_connector_module_path`.

`connector.py` (`NixlConnector`, a subclass of vLLM's pull-mode NIXL connector exported
under vLLM's own name, whose hooks call connector/hooks/), `scheduler.py` and
`worker.py` (its scheduler and worker, which answer and ask for read grants),
`stats.py` (its counters in vLLM's connector stats and Prometheus metrics), `targets.py`
(what these classes override or call in vLLM, checked before vLLM starts; no vLLM
import). The other modules import vLLM: only vLLM's connector factory loads them. Must not
import patches/, plugin, endpoint or launcher.
"""
