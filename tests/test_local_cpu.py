"""The dtype a local stack picks from the CPU's flags (pure; flags injected)."""

import pytest

from bidirkv.local.cpu import CpuInfo, choose_dtype, parse_cpuinfo

ZEN3 = CpuInfo("AMD EPYC", "x86_64", frozenset({"avx", "avx2", "fma", "sha_ni"}), 2)
SKYLAKE = CpuInfo("Intel Xeon Gold 6148", "x86_64", frozenset({"avx2", "avx512f"}), 2)
SAPPHIRE = CpuInfo("Intel Xeon Platinum 8488C", "x86_64",
                   frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}), 2)
GRAVITON2 = CpuInfo("Neoverse-N1", "aarch64", frozenset({"fp", "asimd"}), 2)
GRAVITON3 = CpuInfo("Neoverse-V1", "aarch64", frozenset({"fp", "asimd", "sve", "bf16"}), 2)


@pytest.mark.parametrize("cpu, want", [
    (ZEN3, "float32"), (SKYLAKE, "float32"), (SAPPHIRE, "bfloat16"),
    (GRAVITON2, "float32"), (GRAVITON3, "bfloat16"),
    (CpuInfo("RISC-V", "riscv64", frozenset({"bf16"})), "float32"),  # no flag table: exact
])
def test_auto_picks_bf16_only_where_the_cpu_multiplies_it_natively(cpu, want):
    choice = choose_dtype("auto", cpu)
    assert choice.picked and choice.dtype == want
    assert cpu.model in choice.reason
    assert "picked for this CPU" in choice.line()


def test_an_explicit_dtype_is_kept_and_a_slow_one_is_named():
    kept = choose_dtype("float32", SAPPHIRE)
    assert (kept.dtype, kept.picked) == ("float32", False)
    slow = choose_dtype("bfloat16", ZEN3)
    assert (slow.dtype, slow.picked) == ("bfloat16", False)
    assert "no native bf16" in slow.reason and "auto or float32" in slow.reason
    assert "no native" not in choose_dtype("bfloat16", SAPPHIRE).reason


def test_cpuinfo_of_x86_and_aarch64():
    x86 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\n"
    assert parse_cpuinfo(x86) == ("AMD EPYC", frozenset({"fpu", "avx2", "fma"}))
    arm = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd bf16\nCPU part\t: 0xd40\n"
    assert parse_cpuinfo(arm) == ("unknown CPU", frozenset({"fp", "asimd", "bf16"}))
    assert parse_cpuinfo("") == ("unknown CPU", frozenset())


def test_a_report_names_the_vector_extensions():
    assert ZEN3.isa() == "avx2"
    assert SAPPHIRE.isa() == "avx2 avx512f avx512_bf16 amx_bf16"
    assert ZEN3.to_json()["avx512f"] is False
    assert "AMD EPYC (x86_64, avx2, 2 cores)" == ZEN3.describe()
