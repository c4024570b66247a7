"""Where vLLM itself is touched: guarded patches that fail closed, each naming the sites
it patches (`PatchSite`, connector/targets.py), applied by the plugin when their module is
imported.

Imports `core`, the settings and vLLM; never `plugin`, `launcher` or `endpoint`.
"""
