"""What this machine's CPU can run fast, and the dtype a local stack picks for it.

A local spec may leave `model.dtype` at `auto`; the local stack then picks for the CPU it
finds instead of leaving it to the model file. Measured on 2 cores with the tiny model:
bfloat16 is fast only where the CPU multiplies bf16 natively (AVX-512 BF16 or AMX on
x86-64, the BF16 extension on aarch64). Elsewhere vLLM's CPU kernels fall back to plain
torch linear layers for bf16 ("Failed to create oneDNN linear"), and on an AVX2-only
AMD EPYC 1,000 prompt tokens took 3.9 s through P/D in bf16 against 0.94 s in float32.
float32 is also the exact choice: bf16 greedy output of a random-weight model is not
reproducible from run to run. An explicit dtype in the spec is always kept.

Pure except `read_cpu`, which reads /proc/cpuinfo (Linux) and the platform module.
"""

from __future__ import annotations

import functools
import os
import pathlib
import platform
from dataclasses import dataclass, field

# Flags that say bf16 matrix work runs natively (x86-64 /proc/cpuinfo names, and
# aarch64's "Features" name for the BF16 extension).
NATIVE_BF16 = {"x86_64": ("avx512_bf16", "amx_bf16"), "aarch64": ("bf16",)}
# What is worth naming in a report: the vector extensions the kernels are built for.
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "asimd", "sve", "bf16")


@dataclass(frozen=True)
class CpuInfo:
    model: str
    arch: str  # platform.machine(): x86_64, aarch64, ...
    flags: frozenset[str] = field(default_factory=frozenset)
    cores: int = 1

    def isa(self) -> str:
        """The vector extensions a report names, e.g. 'avx2' or 'avx2 avx512f avx512_bf16'."""
        have = [f for f in REPORTED_FLAGS if f in self.flags]
        return " ".join(have) or "none of " + "/".join(REPORTED_FLAGS)

    def describe(self) -> str:
        return f"{self.model} ({self.arch}, {self.isa()}, {self.cores} cores)"

    def to_json(self) -> dict:
        return {"model": self.model, "arch": self.arch, "isa": self.isa(),
                "cores": self.cores, "avx512f": "avx512f" in self.flags}


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str
    reason: str
    picked: bool  # False: the spec named the dtype and it is kept

    def line(self) -> str:
        how = "picked for this CPU" if self.picked else "from the spec"
        return f"dtype {self.dtype} ({how}): {self.reason}"


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, flags) from /proc/cpuinfo's first processor (x86 'flags', aarch64
    'Features'); the model is 'unknown CPU' when the file names none."""
    model, flags = "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = frozenset(value.split())
        if model and flags:
            break
    return model or "unknown CPU", flags


@functools.lru_cache(maxsize=4)
def read_cpu(cpuinfo: str | os.PathLike[str] = "/proc/cpuinfo") -> CpuInfo:
    """This machine's CPU (flags empty where /proc/cpuinfo cannot be read); read once per
    process, as it does not change under it."""
    try:
        text = pathlib.Path(cpuinfo).read_text(errors="replace")
    except OSError:
        text = ""
    model, flags = parse_cpuinfo(text)
    if model == "unknown CPU" and platform.processor():
        model = platform.processor()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    return CpuInfo(model, platform.machine(), flags, cores)


def native_bf16(cpu: CpuInfo) -> str | None:
    """The flag that gives this CPU native bf16 matrix work, or None."""
    return next((f for f in NATIVE_BF16.get(cpu.arch, ()) if f in cpu.flags), None)


def choose_dtype(spec_dtype: str, cpu: CpuInfo) -> DtypeChoice:
    """The dtype a local stack runs with (pure): the spec's when it names one, else the
    one that is fast on this CPU."""
    bf16 = native_bf16(cpu)
    if spec_dtype != "auto":
        if spec_dtype == "bfloat16" and bf16 is None:
            return DtypeChoice(spec_dtype, f"{cpu.model} has no native bf16 ({cpu.isa()}): "
                               "slower than float32 here; set model.dtype auto or float32",
                               picked=False)
        return DtypeChoice(spec_dtype, f"as written, on {cpu.model}", picked=False)
    if bf16 is not None:
        return DtypeChoice("bfloat16", f"{cpu.model} multiplies bf16 natively ({bf16}); "
                           "outputs are not bit-reproducible (float32 is, for ON == OFF "
                           "checks)", picked=True)
    return DtypeChoice("float32", f"{cpu.model} has no native bf16 ({cpu.isa()}): bf16 would "
                       "fall back to slow kernels; float32 is fast here and exact",
                       picked=True)
