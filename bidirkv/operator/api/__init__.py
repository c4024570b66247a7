"""The DisaggregatedInference API: pydantic models, the one source of the CRD schema.

Owns field names, defaults and validation (with the messages users see). Imports only
`bidirkv.operator.api` itself and the shared modules; never rendering, the CRD
generator or the API client.
"""
