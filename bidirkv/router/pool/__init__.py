"""The engines the router talks to: replicas and pools, which one serves a leg,
their health, and the router's side of decode residency.

Imports `store`, `request` and the leaf modules; never `datapath` or `server`.
"""
