"""Where vLLM itself is touched: guarded patches that fail closed, each naming its
targets (`guarded.Target`), applied by the plugin when their module is imported.

Imports `core`, the settings and vLLM; never `plugin`, `launcher` or `endpoint`.
"""
