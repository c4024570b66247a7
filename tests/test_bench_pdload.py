"""The concurrency report: aims, table and files, from vLLM bench results (no servers)."""

from bidirkv.bench import pdload
from bidirkv.bench.vllmbench import ServeRun


def result(label, c, rps, ttft, p99, itl):
    return {"label": label, "concurrency": c, "request_throughput": rps,
            "median_ttft_ms": ttft, "p99_ttft_ms": p99, "median_itl_ms": itl, "failed": 0}


RESULTS = [
    result(pdload.SINGLE, 1, 12.0, 40.0, 60.0, 3.0),
    result(pdload.ROUTER, 1, 9.5, 58.0, 90.0, 3.2),
    result(pdload.SINGLE, 4, 20.0, 130.0, 200.0, 3.8),
    result(pdload.ROUTER, 4, 17.0, 160.0, 450.0, 5.2),
]


def test_verdicts_compare_the_router_with_the_single_server():
    one, four = pdload.verdicts(RESULTS)
    assert round(one["overhead_ms"]) == 18 and one["overhead_ok"] and one["itl_ok"]
    assert "throughput_ok" not in one
    assert round(four["throughput_ratio"], 2) == 0.85 and not four["throughput_ok"]
    assert round(four["p99_ratio"], 2) == 2.25 and not four["p99_ok"]
    assert not four["itl_ok"]  # +1.4 ms


def test_table_says_which_aims_are_met():
    text = pdload.table(RESULTS)
    assert "P/D overhead +18.0 ms (aim <= 20) met" in text
    assert "req/s ratio 0.85 (aim >= 1) NOT met" in text


def test_files_are_written(tmp_path):
    paths = pdload.write(RESULTS, tmp_path, "t")
    assert (tmp_path / "concurrency.json").exists() and (tmp_path / "concurrency.png").exists()
    assert set(paths) == {"json", "plot"}


def test_a_run_asks_vllm_for_fresh_prompts_and_percentiles():
    argv = ServeRun("http://h:1", "m", "/tok", 4, 48, seed=7).argv("/d", "f.json")
    for flag, value in (("--seed", "7"), ("--max-concurrency", "4"), ("--num-prompts", "48"),
                        ("--tokenizer", "/tok"), ("--metric-percentiles", "50,99")):
        assert argv[argv.index(flag) + 1] == value


def test_a_router_with_lower_itl_than_the_single_server_meets_the_itl_aim():
    faster = [result(pdload.SINGLE, 4, 20.0, 130.0, 200.0, 17.0),
              result(pdload.ROUTER, 4, 21.0, 128.0, 190.0, 15.6)]
    (four,) = pdload.verdicts(faster)
    assert round(four["itl_delta_ms"], 1) == -1.4 and four["itl_ok"]
    assert "ITL p50 -1.4 ms (aim <= +1) met" in pdload.table(faster)


def test_rounds_compare_each_pair_then_take_the_median():
    rounds = []
    for n, (single, router) in enumerate([(300.0, 310.0), (280.0, 282.0), (250.0, 320.0)]):
        for label, ttft in ((pdload.SINGLE, single), (pdload.ROUTER, router)):
            rounds.append({**result(label, 1, 2.0, ttft, ttft, 20.0), "round": n})
    (one,) = pdload.verdicts(rounds, pdload.COST_AIMS)
    # The pairs differ by +10, +2 and +70 ms: a drift between runs moves one pair only.
    assert one["rounds"] == 3 and one["overhead_ms"] == 10.0 and not one["overhead_ok"]
    assert "c=1 (median of 3 rounds): P/D overhead +10.0 ms (aim <= 5) NOT met" in \
        pdload.table(rounds, pdload.COST_AIMS)


def test_each_run_records_the_servers_cpu_per_request_and_the_verdict_their_ratio():
    assert pdload.cpu_per_request(10.0, 16.0, 48) == 125.0
    assert pdload.cpu_per_request(None, 16.0, 48) is None  # no account of the servers
    assert pdload.cpu_per_request(10.0, 16.0, 0) is None  # nothing completed
    runs = [{**result(pdload.SINGLE, 4, 8.0, 330.0, 500.0, 9.0), "cpu_ms_per_request": 140.0},
            {**result(pdload.ROUTER, 4, 9.0, 250.0, 480.0, 10.0), "cpu_ms_per_request": 189.0}]
    (four,) = pdload.verdicts(runs)
    assert round(four["cpu_ratio"], 2) == 1.35
    text = pdload.table(runs)
    assert "    140ms" in text and "    189ms" in text
    assert "servers' CPU per request 1.35x the single server's" in text
    assert "cpu_ratio" not in pdload.verdicts(RESULTS)[1]  # runs without the account
