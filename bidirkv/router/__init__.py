"""The KV-cache-aware router: one client request -> a prefill leg and a decode leg, with
the conversation's decode handle kept between turns.

Layers, each importing only those before it: the leaf modules (`config`, `codec`,
`metrics`) -> `tracing` (spans) -> `request` (client input: checks, identity, the
router's own answers) and `store` (handles) -> `pool` (replicas, their health and
residency) -> `engine` (the engine client) -> `datapath` (a turn, top to bottom) ->
`server` (aiohttp app and routes). Nothing here imports the operator or the engine
plugin; the wire format is `bidirkv.wire`.
"""
