"""The engine side's rules, free of vLLM: handle admission and sealing, block
digests, how much of a peer's KV to read, decode's retained-KV cache, the read-grant
messages and the streamed-params rewriting.

Imports the shared modules only; never vLLM at module level and never `patches`.
"""
