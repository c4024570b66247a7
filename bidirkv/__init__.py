"""bidir-kv: operator, router and connector for 1PnD vLLM with bidirectional KV transfer."""
