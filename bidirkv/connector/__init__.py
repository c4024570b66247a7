"""The engine side: the vLLM plugin that verifies and serves reuse, the pod launcher
(`bidir-kv serve`) and the engines' residency endpoint.

Layers: `core` (pure rules, no vLLM import) -> `patches` (where vLLM is touched) ->
`plugin`, `launcher`, `endpoint`. Nothing here imports the operator or the router; the
wire format is `bidirkv.wire`.
"""
