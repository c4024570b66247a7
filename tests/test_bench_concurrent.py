"""The concurrent benchmark against the real router with fake engines: in-flight bound,
turn order per conversation, think time, errors, the summary, the files it writes."""

from __future__ import annotations

import asyncio
import json

from fake_engine import Cluster

from bidirkv.bench import concurrent, loadreport
from bidirkv.cli import main as cli_main

SMALL = {"conversations": 5, "turns": 3, "concurrency": 2, "think_s": 0.05,
         "stagger_s": 0.0, "first_tokens": 30, "new_tokens": 10, "output_tokens": 4}


async def run_load(cluster: Cluster, **kw) -> concurrent.ConcurrentRun:
    cfg = concurrent.ConcurrentConfig(url=cluster.url, label="t", **{**SMALL, **kw})
    return await asyncio.to_thread(concurrent.run, cfg, False)


async def test_pool_in_flight_bound_and_turn_order():
    async with Cluster() as c:
        c.d[0].behaviour.chunk_delay = 0.02
        run = await run_load(c)
        recs = run.records
        assert len(recs) == 15 and not any(r.error for r in recs)
        # Each conversation's turns in order, never overlapping, think time between them.
        for i in range(5):
            mine = sorted((r for r in recs if r.conversation == i), key=lambda r: r.turn)
            assert [r.turn for r in mine] == [1, 2, 3]
            for a, b in zip(mine, mine[1:], strict=False):
                assert b.start_s >= a.start_s + a.total_s + 0.05 - 0.01
        # Never more than `concurrency` requests in flight.
        events = sorted([(r.start_s, 1) for r in recs] +
                        [(r.start_s + r.total_s, -1) for r in recs])
        depth = peak = 0
        for _, step in events:
            depth += step
            peak = max(peak, depth)
        assert peak <= 2
        assert run.router["reuse_hit"] == 10  # every later turn found its handle


async def test_errors_end_their_conversation_and_are_counted():
    async with Cluster() as c:
        c.d[0].behaviour.fail_next, c.d[0].behaviour.status_next = 2, 400
        run = await run_load(c, concurrency=1)
        errors = [r for r in run.records if r.error]
        assert len(errors) == 2
        s = loadreport.summary([r.to_json() for r in run.records], run.wall_s, run.router)
        assert s["errors"] == 2 and s["requests"] == len(run.records) == 15 - 2 * 2
        assert s["ttft_p50_s"] is not None and s["throughput_rps"] > 0


def test_percentile():
    assert loadreport.percentile([], 50) is None
    assert loadreport.percentile([3.0], 99) == 3.0
    assert loadreport.percentile([1, 2, 3, 4], 50) == 2.5
    assert abs(loadreport.percentile(list(range(101)), 99) - 99) < 1e-9


async def test_cli_writes_json_and_plot_inputs(tmp_path):
    async with Cluster() as c:
        rc = await asyncio.to_thread(cli_main, [
            "bench", "--url", c.url, "--label", "x", "--concurrency", "2", "--conversations",
            "3", "--turns", "2", "--first-tokens", "10", "--new-tokens", "5",
            "--output-tokens", "3", "--think", "0", "--out", str(tmp_path), "--no-progress"])
        assert rc == 0
        doc = json.loads((tmp_path / "x-load.json").read_text())
        assert doc["kind"] == loadreport.LOAD_KIND and doc["summary"]["requests"] == 6
        png = loadreport.ttft_over_time_plot({"x": doc}, tmp_path / "t.png", "t")
        assert png.stat().st_size > 1000
