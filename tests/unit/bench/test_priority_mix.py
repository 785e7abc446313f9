"""``blade_llm_bench --priority_mix``: two priority classes sent (or only tagged, for the fcfs
baseline) and TTFT / E2E reported per class in the table, JSON, CSV and comparison."""

import csv
import json
import random

import pytest

from bench_fake_server import FakeOpenAIServer
from bladellm.bench.client import RequestOptions, RequestResult, build_payload
from bladellm.bench.datasets import BenchRequest, assign_priority_classes
from bladellm.bench.metrics import summarize, summarize_by_priority
from bladellm.entrypoints.cli.bench import main


def test_classes_are_drawn_by_seed_in_the_asked_proportion():
    reqs = [BenchRequest(f"p{i}", 3, 4) for i in range(50)]
    assign_priority_classes(reqs, 0.2, random.Random("s"))
    first = [r.priority for r in reqs]
    assert first.count(0) == 10 and first.count(1) == 40
    assign_priority_classes(reqs, 0.2, random.Random("s"))
    assert [r.priority for r in reqs] == first
    with pytest.raises(ValueError, match="^--priority_mix:"):
        assign_priority_classes(reqs, 1.0, random.Random(0))


def test_payload_carries_the_class_unless_told_not_to():
    req = BenchRequest("hi", 1, 4, priority=0)
    assert build_payload(req, RequestOptions(model="m"))["priority"] == 0
    assert "priority" not in build_payload(req, RequestOptions(model="m", send_priority=False))
    assert "priority" not in build_payload(BenchRequest("hi", 1, 4), RequestOptions(model="m"))


def test_per_class_summary():
    results = [RequestResult(success=True, ttft=0.01 * (i + 1), e2e=0.1, output_tokens=3,
                             priority=i % 2) for i in range(6)]
    results.append(RequestResult(success=False, error="x", priority=1))
    classes = summarize_by_priority(results)
    assert set(classes) == {"0", "1"}
    assert classes["0"]["completed"] == 3 and classes["1"]["num_requests"] == 4
    assert classes["0"]["ttft_ms"]["mean"] == pytest.approx(30.0)  # 10, 30, 50 ms
    assert classes["1"]["ttft_ms"]["mean"] == pytest.approx(40.0)  # 20, 40, 60 ms
    assert summarize_by_priority([RequestResult(success=True)]) is None
    assert "priority_classes" not in summarize([RequestResult(success=True)], 1.0)


@pytest.mark.parametrize("send", [True, False])
def test_cli_reports_ttft_per_class(tmp_path, capsys, send):
    out = tmp_path / "out"
    extra = [] if send else ["--no_priority_field"]
    with FakeOpenAIServer(ttft_s=0.01, itl_s=0.005) as srv:
        assert main(["--base_url", srv.base_url, "--num_prompts", "8", "--input_len_range",
                     "4,4", "--output_len_range", "3,3", "--output_dir", str(out),
                     "--label", "fake", "--disable_tqdm", "--priority_mix", "0.25",
                     *extra]) == 0
        sent = [p.get("priority") for p in srv.payloads]
    assert sorted(sent, key=str) == ([0, 0, 1, 1, 1, 1, 1, 1] if send else [None] * 8)
    entry = json.loads((out / "fake.json").read_text())["rates"][0]
    classes = entry["priority_classes"]
    assert {k: v["completed"] for k, v in classes.items()} == {"0": 2, "1": 6}
    assert sorted(r["priority"] for r in entry["requests"]) == [0, 0, 1, 1, 1, 1, 1, 1]
    row = next(csv.DictReader((out / "fake.csv").open()))
    assert float(row["prio0_ttft_mean_ms"]) == pytest.approx(classes["0"]["ttft_ms"]["mean"])
    assert "rate inf priority 0: 2/2 ok, TTFT mean/p50/p90/p99" in capsys.readouterr().out
    plots = tmp_path / "plots"
    assert main(["plot", str(out / "fake.json"), "--output_dir", str(plots)]) == 0
    md = (plots / "comparison.md").read_text()
    assert "| rate | server | priority | requests |" in md and "| inf | fake | 1 | 6 |" in md


@pytest.mark.parametrize("argv,flag", [(["--priority_mix", "1.5"], "--priority_mix"),
                                       (["--priority_mix", "0"], "--priority_mix"),
                                       (["--no_priority_field"], "--no_priority_field")])
def test_bad_priority_flags_are_usage_errors(tmp_path, capsys, argv, flag):
    with pytest.raises(SystemExit) as exc:
        main(["--base_url", "http://127.0.0.1:9", "--model", "m", "--output_dir",
              str(tmp_path), *argv])
    assert exc.value.code == 2 and flag in capsys.readouterr().err
