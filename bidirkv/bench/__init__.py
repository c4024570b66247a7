"""Multi-turn TTFT benchmark of a 1PnD router: bidirectional KV transfer ON vs OFF.

Works against any OpenAI-compatible router URL; the local stack (`bidir-kv local up`) and
`make demo` add the engines' own metrics (KV transfer time, tokens reused) and a lower
bound measured on a server that holds the history in its local prefix cache.
"""
