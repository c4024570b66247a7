"""One turn on the data path, top to bottom (`flow.py`): its admission, its conversation
and handle, its plan, its legs with their fallbacks and retries, the answer relayed and
the next handle kept; and the parts that serve it (the shared `Context`, health, upkeep,
the `Router` that builds them).

Imports `engine`, `tracing`, `pool`, `store`, `request` and the leaf modules; never
`server`.
"""
