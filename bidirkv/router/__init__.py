"""The KV-cache-aware router: one client request -> a prefill leg and a decode leg, with
the conversation's decode handle kept between turns.

Layers, each importing only those before it: the leaf modules (`config`, `codec`,
`metrics`) -> `request` (client input: checks, identity) and `store` (handles) ->
`pool` (replicas, drains and residency) -> `datapath` (a turn's legs, the engines'
health) -> `server` (aiohttp app and routes). Nothing here imports the operator or the
engine plugin; the wire format is `bidirkv.wire`.
"""
