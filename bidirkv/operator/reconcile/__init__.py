"""Reconciliation: compare rendered children with the API server's, compute the
status, and the level-based controller that drives both.

Imports `api`, `render` and `kube`; never `main` (the kopf wiring) or the CRD
generator.
"""
