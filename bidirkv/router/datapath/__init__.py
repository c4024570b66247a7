"""One turn on the data path: the prefill leg, the decode leg, streaming, retries,
prefill-only mode and the handle taken and stored around them.

Imports `pool`, `store`, `request` and the leaf modules; never `server`.
"""
