"""The vLLM platform each process the project starts resolves, on whatever CPU runs this.

A process that resolves no platform loads the kernel library of one CPU build (AVX-512
BF16 on x86-64) and dies of SIGILL on every other CPU: the check is on the platform, so
it fails on any machine, not only on the CPUs where the fault shows.
"""

import importlib.util
import subprocess
import sys

import pytest

from bidirkv.bench import vllmbench

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm not importable: installed by `make engine`")


def test_the_load_generator_process_resolves_the_cpu_platform():
    assert vllmbench.resolved_platform() == "CpuPlatform"


def test_the_load_generator_refuses_to_run_without_a_platform():
    # The same prelude, with platform detection made to find nothing.
    code = ("import vllm.platforms as p\n"
            "p.builtin_platform_plugins = {}\n" + vllmbench._PLATFORM)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=vllmbench.child_env())
    assert proc.returncode != 0
    assert "resolved no platform" in proc.stderr


def test_a_server_started_by_the_launcher_resolves_a_platform():
    from bidirkv.connector.launcher import platform_error

    assert platform_error() is None
