"""The roles' configuration (bidirkv/roleconfig.py) reads a spec through its own `Spec`
protocol, not the operator's models (dependencies run one way): the operator's spec must
still offer every attribute the protocol names, at every depth."""

import typing

from bidirkv import roleconfig
from bidirkv.operator.api.spec import parse_spec


def _protocol(hint):
    """The Protocol class a hint names (through `X | None` and `Sequence[X]`), or None."""
    for arg in (hint, *typing.get_args(hint)):
        if isinstance(arg, type) and getattr(arg, "_is_protocol", False):
            return arg
    return None


def _missing(obj, protocol, path):
    missing = []
    for name, hint in typing.get_type_hints(protocol).items():
        if not hasattr(obj, name):
            missing.append(f"{path}.{name}")
            continue
        inner, value = _protocol(hint), getattr(obj, name)
        if inner is not None and value is not None:
            for item in value if isinstance(value, list) else [value]:
                missing += _missing(item, inner, f"{path}.{name}")
    missing += [f"{path}.{name}()" for name in vars(protocol)
                if callable(vars(protocol)[name]) and not name.startswith("_")
                and not callable(getattr(obj, name, None))]
    return missing


def test_the_operators_spec_offers_what_roleconfig_reads():
    spec = parse_spec({
        "model": {"name": "m"},
        "engine": {"extraEnv": [{"name": "A", "value": "1"}]},
        "monitoring": {"tracing": {"otlpEndpoint": "https://c:4318/v1/traces",
                                   "headersSecretRef": {"name": "s", "key": "k"}}},
    })
    assert _missing(spec, roleconfig.Spec, "spec") == []


def test_the_check_sees_a_missing_attribute():
    class Short:
        name = "m"

    assert _missing(Short(), roleconfig.Model, "spec.model") == [
        "spec.model.served_name", "spec.model.dtype", "spec.model.max_model_len"]
