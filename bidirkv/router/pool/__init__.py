"""The engines the router talks to: replicas and pools (their health as datapath/health.py
last found it), which one serves a leg, drains, and the router's side of decode residency.

Imports `store`, `request` and the leaf modules; never `engine`, `datapath` or
`server`.
"""
