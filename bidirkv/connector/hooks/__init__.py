"""What bidir-kv's NIXL connector does at vLLM's connector hooks, kept apart from vLLM.

`reuse.py` (admit and sign handles, narrow reads to the verified prefix), `retention.py`
(decode's retained requests: tracked, released, freed) and `tally.py` (their counters for
the connector's stats). Each takes vLLM's scheduler-side connector state as a plain object,
so tests drive them with stand-ins; the classes that vLLM loads are in
`bidirkv/connector/nixl/`. Must not import vLLM or torch at module level, nor patches/,
nixl/ or plugin.
"""
