"""Which phases `make demo` runs for which flags: the headline (control plane, ON, OFF and
the bound) by default, every other phase behind a flag, the --skip-* flags winning."""

import pytest

from bidirkv.demo import OPTIONAL_PHASES, parse_args, phases

HEADLINE = {"control-plane", "multi-turn"}
EVERYTHING = HEADLINE | set(OPTIONAL_PHASES)


@pytest.mark.parametrize(("flags", "expected"), [
    ([], HEADLINE),
    (["--all"], EVERYTHING),
    (["--with-pressure"], HEADLINE | {"pressure"}),
    (["--with-concurrency"], HEADLINE | {"concurrency"}),
    (["--with-placement", "--with-concurrency"], HEADLINE | {"placement", "concurrency"}),
    (["--with-span-tree"], HEADLINE | {"span-tree"}),
    (["--skip-control-plane"], {"multi-turn"}),
    (["--all", "--skip-pressure"], EVERYTHING - {"pressure"}),
    (["--all", "--skip-placement", "--skip-concurrency"],
     EVERYTHING - {"placement", "concurrency"}),
    (["--with-pressure", "--skip-pressure"], HEADLINE),
    (["--only-pressure"], {"control-plane", "pressure"}),
    (["--only-pressure", "--skip-control-plane"], {"pressure"}),
    # --only-pressure keeps its meaning under --all: nothing but the pressure run.
    (["--only-pressure", "--all"], {"control-plane", "pressure"}),
])
def test_phases_follow_the_flags(flags, expected):
    assert phases(parse_args(flags)) == expected


def test_the_default_leaves_every_optional_phase_out():
    assert not phases(parse_args([])) & set(OPTIONAL_PHASES)
