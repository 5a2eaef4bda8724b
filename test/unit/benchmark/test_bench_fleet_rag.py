"""``bench_fleet_rag.py``'s pieces that need no fleet: flags, the router's metrics, the summary."""

from __future__ import annotations

import pytest

from benchmark import bench_fleet_rag

# lines of sglang-router 0.3.2's /metrics, as a fleet of two served them
METRICS = """\
# TYPE smg_worker_cb_outcomes_total counter
smg_worker_cb_outcomes_total{worker="http://127.0.0.1:59287",outcome="success"} 12
smg_worker_cb_outcomes_total{worker="http://127.0.0.1:59288",outcome="success"} 3
smg_worker_cb_outcomes_total{worker="http://127.0.0.1:59288",outcome="failure"} 1
smg_worker_cb_state{worker="http://127.0.0.1:59287"} 0
smg_worker_cb_state{worker="http://127.0.0.1:59288"} 1
"""


def test_engine_arguments_become_flags():
    assert bench_fleet_rag.flags({"model_path": "m", "skip_tokenizer_init": True,
                                  "disable_x": False, "page_size": 16, "y": None}) == \
        ["--model-path", "m", "--skip-tokenizer-init", "--page-size", "16"]


def test_the_routers_metrics_give_each_workers_successes_and_closed_circuits(monkeypatch):
    side = object.__new__(bench_fleet_rag.Side)
    monkeypatch.setattr(bench_fleet_rag.Side, "_metrics", lambda self: METRICS)
    assert side.worker_counts() == {"http://127.0.0.1:59287": 12.0,
                                    "http://127.0.0.1:59288": 3.0}
    assert side.healthy_workers() == 1


def test_the_summary_compares_each_side_with_vanilla_per_cell():
    def cell(rate: float, ttft: float) -> dict:
        return {"ideal_median": 3.0, "requests_per_s_median": rate, "ttft_p50_ms_median": ttft,
                "stream_ttft_p50_ms": ttft / 2, "stream_ttft_p99_ms": ttft, "errors": 0}

    report = {"results": {"vanilla": {"cells": {"a": cell(2.0, 400.0)}},
                          "sglang-pic": {"cells": {"a": cell(5.0, 100.0)}},
                          "sglang-pic-rr": {"error": "did not start"}}}
    (row,) = bench_fleet_rag.summarize(report)
    assert row["variant"] == "sglang-pic" and row["throughput_ratio"] == pytest.approx(2.5)
    assert row["ttft_p50_ratio"] == pytest.approx(4.0)
    assert row["stream_ttft_p50_ratio"] == pytest.approx(4.0)


def test_only_the_span_routed_side_sends_a_routing_key_and_only_for_span_prompts():
    from sglang_pic.fleet.routing import ROUTING_KEY_HEADER, span_routing_key

    def side(name: str):
        s = object.__new__(bench_fleet_rag.Side)
        s.name, s.key, s.args = name, "sk-test", type("Args", (), {"instances": 3})
        return s

    spans = [5, -1, 1, 2, -1, 3, -2, 9]
    got = bench_fleet_rag.headers(side("sglang-pic-span"), spans)
    assert got == {"Authorization": "Bearer sk-test", ROUTING_KEY_HEADER: span_routing_key(spans)}
    assert ROUTING_KEY_HEADER not in bench_fleet_rag.headers(side("sglang-pic-span"), [1, 2])
    assert ROUTING_KEY_HEADER not in bench_fleet_rag.headers(side("sglang-pic"), spans)
    assert bench_fleet_rag.headers(side("sglang-pic-group"), spans)[ROUTING_KEY_HEADER] \
        == span_routing_key(spans, buckets=3)


def test_progress_names_the_newest_log_and_its_last_line(tmp_path):
    import os

    (tmp_path / "old.log").write_text("first\nolder line\n")
    (tmp_path / "fleet").mkdir()
    (tmp_path / "fleet" / "instance-0.log").write_text("loading\rCapturing 3/58\n")
    os.utime(tmp_path / "old.log", (1, 1))
    assert bench_fleet_rag._last_line(tmp_path) == "instance-0.log: Capturing 3/58"
    assert bench_fleet_rag._last_line(tmp_path / "fleet" / "none") == ""


def test_a_resumed_side_runs_only_the_cells_it_lacks():
    """A side cut off after some cells is resumed with them: ``run_side`` measures only the
    cells its report lacks (here none, so it never touches the side or saves)."""
    class Untouchable:
        name = "sglang-pic"

        def __getattr__(self, attr):
            raise AssertionError(f"the side was used: {attr}")

    cells = {"aligned": {"requests_per_s": [1.0]}}
    saves = []
    bench_fleet_rag.run_side(Untouchable(), {"cells": ["aligned"], "output_tokens": 8}, {}, print, cells,
             lambda: saves.append(1))
    assert cells == {"aligned": {"requests_per_s": [1.0]}} and not saves


@pytest.mark.parametrize("name,stores,spans", [("sglang-pic", "2", True),
                                               ("sglang-pic-nostore", "0", True)])
def test_a_span_side_starts_its_fleet_with_or_without_stores(tmp_path, monkeypatch, name, stores,
                                                             spans):
    """``sglang-pic-nostore`` is the span fleet without stores: it separates what the span
    store tier costs or gains from the span cache itself."""
    from types import SimpleNamespace

    class Started(Exception):
        pass

    spawned: list[list[str]] = []
    monkeypatch.setattr(bench_fleet_rag.Side, "_spawn",
                        lambda self, cmd, log, env=None: spawned.append(cmd))
    monkeypatch.setattr(bench_fleet_rag.Side, "_wait",
                        lambda self, *a, **k: (_ for _ in ()).throw(Started()))
    args = SimpleNamespace(instances=2, stores=2, gpus=1)
    side = bench_fleet_rag.Side(name, args, False, tmp_path, tmp_path)
    with pytest.raises(Started):
        side.start()
    cmd = spawned[0]
    assert cmd[cmd.index("--stores") + 1] == stores
    assert ("--enable-span-cache" in cmd) is spans
    assert ("--store-ports" in cmd) is (stores != "0")


def test_the_prefill_rate_is_read_from_the_burst_s_full_prefill_batches(tmp_path):
    """Lines as SGLang 0.5.17 logs them (the H200 fleet run's): only the lines written since
    the burst began count, and only batches of a full chunk (a lone short prompt's batch
    measures the idle gap before it)."""
    line = ("[2026-12-06 02:51:03] Prefill batch, #new-seq: 7, #new-token: {n}, #cached-token: 0, "
            "token usage: 0.31, #running-req: 6, #queue-req: 53, #pending-token: 180414, cuda "
            "graph: True, input throughput (token/s): {rate}\n")
    a, b = tmp_path / "instance-0.log", tmp_path / "instance-1.log"
    a.write_text(line.format(n=8192, rate=99999.0))  # before the burst
    b.write_text("")
    since = bench_fleet_rag.log_sizes([a, b])
    with open(a, "a") as f:
        f.write(line.format(n=8192, rate=6000.0) + line.format(n=64, rate=34.3))
    b.write_text(line.format(n=8192, rate=7000.0) + line.format(n=5000, rate=5000.0))
    assert bench_fleet_rag.prefill_rate(since) == 6000.0
    assert bench_fleet_rag.prefill_rate(bench_fleet_rag.log_sizes([a, b])) is None


def test_each_instance_s_kv_pool_is_read_from_its_log(tmp_path):
    """The line SGLang 0.5.17 logs once its pool is allocated (the H100 fleet run's: the second
    instance on the GPU got a seventh of the first's pool); None where a log lacks it."""
    line = ("[2026-12-06 05:37:16] max_total_num_tokens={n}, chunked_prefill_size=8192, "
            "max_prefill_tokens=16384, max_running_requests=2048, context_len=65536, "
            "available_gpu_mem=43.98 GB\n")
    logs = [tmp_path / f"instance-{i}.log" for i in range(3)]
    logs[0].write_text("loading\n" + line.format(n=133863))
    logs[1].write_text(line.format(n=18342) + line.format(n=1))
    logs[2].write_text("still loading\n")
    assert bench_fleet_rag.kv_pool_tokens([*logs, tmp_path / "none.log"]) == [
        133863, 18342, None, None]


def test_a_side_records_its_attention_backend_where_its_instances_agree(tmp_path):
    """headlines.py refuses a baseline not on FlashInfer: the side records what its instances'
    server_args say, and nothing where they differ or are silent."""
    line = "[2026-12-06 08:16:30] server_args=(model_path='m', attention_backend='{b}')\n"
    a, b, c = (tmp_path / f"{n}.log" for n in "abc")
    a.write_text(line.format(b="flashinfer"))
    b.write_text("loading\n" + line.format(b="flashinfer"))
    c.write_text(line.format(b="pic_flashinfer"))
    assert bench_fleet_rag.attention_backend([a, b]) == "flashinfer"
    assert bench_fleet_rag.attention_backend([a, c]) is None
    assert bench_fleet_rag.attention_backend([a, tmp_path / "none.log"]) is None


def test_the_span_store_counters_are_read_from_an_instances_metrics_page():
    """What each burst records of the span store tier (bench_fleet_rag's ``span_store``): every
    ``sglang_pic:span_store_*_total`` counter by its short name, labels or not; nothing else."""
    from sglang_pic.spans.store_tier import COUNTERS

    page = "\n".join([
        "# HELP sglang_pic:span_store_dropped_units_total Span units not saved.",
        "# TYPE sglang_pic:span_store_dropped_units_total counter",
        'sglang_pic:span_store_dropped_units_total{model_name="m"} 3.0',
        "sglang_pic:span_store_loaded_tokens_total 1336.0",
        "sglang_pic:span_store_dropped_units_created 1.7e9",
        'sglang:num_requests_total{model_name="m"} 9.0',
    ])
    assert bench_fleet_rag.span_store_counters(page) == {"dropped_units": 3.0,
                                                         "loaded_tokens": 1336.0}
    # the names the bench prints are the tier's own counters
    assert {"saved_blocks", "dropped_units", "loaded_units", "loaded_tokens",
            "missed_units"} <= set(COUNTERS)
