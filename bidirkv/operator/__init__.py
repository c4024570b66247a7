"""The operator: the DisaggregatedInference API, what it renders, its CRD, and the
reconciler that keeps a cluster's children equal to the rendering.

Layers, each importing only those before it: `api` (pydantic models, the one source of
the schema) -> `render` (pure: a resource -> its child objects) and `crd` (the schema) ->
`kube` (the API client) -> `reconcile` (diff, status, the controller) -> `main` (kopf).
Nothing here imports the router or the engine plugin (`bidirkv.connector`).
"""
