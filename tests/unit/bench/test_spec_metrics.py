"""Speculative-decoding acceptance in blade_llm_bench: read from the server's /metrics before
and after each rate, reported only when the server has the counters (issue 9, item 5)."""

import csv
import json

import pytest

from bench_fake_server import FakeOpenAIServer
from bladellm.bench.report import format_markdown_comparison, format_table, rate_entry, write_csv
from bladellm.bench.client import RequestResult
from bladellm.bench.metrics import SLO
from bladellm.bench.spec_metrics import parse_prometheus_text, spec_counters, spec_delta
from bladellm.entrypoints.cli.bench import main

# What BladeLLM's /metrics looks like with --metrics_names both (prometheus_client's rendering),
# plus the per-position counter vLLM has, which must not be taken for a total.
PAGE = """\
# HELP vllm:spec_decode_num_drafts Request-steps that verified proposed tokens.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{model_name="/models/a b{x}"} 40.0
vllm:spec_decode_num_drafts_created{model_name="/models/a b{x}"} 1.7e+09
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{model_name="/models/a b{x}"} 120.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{model_name="/models/a b{x}"} 60.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 999.0
# TYPE bladellm_spec_decode_num_drafts counter
bladellm_spec_decode_num_drafts_total 40.0
bladellm_spec_decode_num_draft_tokens_total 120.0
bladellm_spec_decode_num_accepted_tokens_total 60.0
vllm:num_requests_running{model_name="m"} 3.0
"""


def test_parse_prometheus_text_sums_label_sets_and_skips_comments():
    text = ('# HELP x doc with {braces} and "quotes"\n'
            'x_total{a="1",b="sp ace"} 2.0\n'
            'x_total{a="2",b="with \\"}\\" quote"} 3.5 1700000000000\n'
            "y 7\n"
            "z NaN\n"
            "broken{ 1\n")
    assert parse_prometheus_text(text) == {"x_total": 5.5, "y": 7.0}


def test_spec_counters_prefers_vllm_names_and_never_double_counts():
    c = spec_counters(PAGE)
    assert c == {"num_drafts": 40.0, "num_draft_tokens": 120.0, "num_accepted_tokens": 60.0,
                 "source": "vllm:spec_decode_*"}
    ours = "\n".join(line for line in PAGE.splitlines() if not line.startswith("vllm:"))
    c = spec_counters(ours)
    assert c["source"] == "bladellm_spec_decode_*" and c["num_accepted_tokens"] == 60.0


def test_spec_counters_absent_is_none():
    assert spec_counters("") is None
    assert spec_counters('vllm:num_requests_running{model_name="m"} 1.0\n') is None
    assert spec_counters("<html>404</html>") is None
    # Accepted tokens alone say nothing about acceptance.
    assert spec_counters("vllm:spec_decode_num_accepted_tokens_total 3\n") is None


def test_spec_delta_acceptance_rate_and_mean_acceptance_length():
    before = spec_counters(PAGE)
    after = spec_counters(PAGE.replace("40.0", "50.0").replace("120.0", "150.0")
                          .replace("60.0", "84.0"))
    d = spec_delta(before, after)
    assert (d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"]) == (10, 30, 24)
    assert d["acceptance_rate"] == pytest.approx(24 / 30)
    assert d["mean_acceptance_length"] == pytest.approx(1 + 24 / 10)  # vLLM's definition
    # Counters present but nothing speculated during the run: counts 0, no ratios.
    d = spec_delta(before, before)
    assert d["num_draft_tokens"] == 0
    assert d["acceptance_rate"] is None and d["mean_acceptance_length"] is None
    # A total that went down (server restarted), a missing scrape, mixed spellings: unknown.
    assert spec_delta(after, before) is None
    assert spec_delta(None, after) is None and spec_delta(before, None) is None
    ours = spec_counters("\n".join(line for line in PAGE.splitlines()
                                   if not line.startswith("vllm:")))
    assert spec_delta(ours, after) is None


def test_older_vllm_without_num_drafts_gives_the_rate_only():
    page = ("vllm:spec_decode_num_draft_tokens_total 10\n"
            "vllm:spec_decode_num_accepted_tokens_total 4\n")
    before = spec_counters(page)
    after = spec_counters(page.replace(" 10", " 30").replace(" 4", " 9"))
    d = spec_delta(before, after)
    assert d["num_drafts"] is None and d["acceptance_rate"] == pytest.approx(5 / 20)
    assert d["mean_acceptance_length"] is None


def _entry(rate, spec):
    results = [RequestResult(success=True, ttft=0.01, itl=[0.01] * 3, e2e=0.05,
                             prompt_tokens=4, output_tokens=4)]
    return rate_entry(rate, results, 1.0, SLO(), spec_decode=spec)


SPEC = {"source": "vllm:spec_decode_*", "num_drafts": 10, "num_draft_tokens": 30,
        "num_accepted_tokens": 24, "acceptance_rate": 0.8, "mean_acceptance_length": 3.4}


def test_table_markdown_and_csv_show_spec_columns_only_when_reported(tmp_path):
    with_spec = {"label": "la", "rates": [_entry(1.0, SPEC), _entry(float("inf"), SPEC)]}
    without = {"label": "plain", "rates": [_entry(1.0, None), _entry(float("inf"), None)]}
    assert "spec_decode" not in without["rates"][0]

    table = format_table(with_spec)
    header, row = table.splitlines()[1], table.splitlines()[3]
    assert "accept" in header and "acc len" in header
    assert row.split()[-2:] == ["80.0%", "3.40"]
    plain = format_table(without)
    assert "accept" not in plain and "%" not in plain

    md = format_markdown_comparison([with_spec, without]).splitlines()
    assert md[0].endswith("| draft acceptance | mean acceptance length |")
    assert md[1].count("---") == 11
    assert md[2].endswith("| 80.0% | 3.40 |")  # rate 1, la
    assert md[3].endswith("| - | - |")  # rate 1, plain: not reported, not zero
    assert "draft acceptance" not in "\n".join(format_markdown_comparison([without]).splitlines())

    # A server with counters but no speculation (normal decoding): counts kept, no columns.
    idle = dict(SPEC, num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0,
                acceptance_rate=None, mean_acceptance_length=None)
    assert "accept" not in format_table({"label": "n", "rates": [_entry(1.0, idle)]})

    mixed = {"label": "m", "rates": [_entry(1.0, None), _entry(2.0, SPEC)]}
    write_csv(str(tmp_path / "m.csv"), mixed)
    rows = list(csv.DictReader((tmp_path / "m.csv").open()))
    assert rows[0]["spec_acceptance_rate"] == "" and rows[1]["spec_acceptance_rate"] == "0.8"
    assert rows[1]["spec_mean_acceptance_length"] == "3.4"
    assert rows[1]["spec_num_drafts"] == "10"
    write_csv(str(tmp_path / "p.csv"), without)
    assert not any(k.startswith("spec_") for k in
                   next(csv.DictReader((tmp_path / "p.csv").open())))


def _bench(tmp_path, srv, *extra):
    out = tmp_path / "out"
    argv = ["--base-url", srv.base_url, "--num_prompts", "6", "--input_len_range", "4,8",
            "--output-len-range", "5,5", "--output_dir", str(out), "--label", "fake",
            "--disable_tqdm", "--request_rate", "50,inf", *extra]
    assert main(argv) == 0
    return out, json.loads((out / "fake.json").read_text())


def test_cli_reports_acceptance_scraped_around_each_rate(tmp_path, capsys):
    # Per request: 2 drafts of 3 tokens, 4 accepted -> rate 4/6, mean length 1 + 4/2 = 3.
    with FakeOpenAIServer(ttft_s=0.01, itl_s=0.005, metrics=True,
                          spec_per_request=(2, 6, 4)) as srv:
        out, run = _bench(tmp_path, srv, "--num_warmup", "2")
        assert srv.metrics_scrapes == 4  # before and after each of the two rates
    for e in run["rates"]:
        spec = e["spec_decode"]
        # Only this rate's 6 requests: not the warm-up's, not the other rate's.
        assert (spec["num_drafts"], spec["num_draft_tokens"],
                spec["num_accepted_tokens"]) == (12, 36, 24)
        assert spec["acceptance_rate"] == pytest.approx(4 / 6)
        assert spec["mean_acceptance_length"] == pytest.approx(3.0)
        assert spec["source"] == "vllm:spec_decode_*"
    printed = capsys.readouterr().out
    assert "acc len" in printed and "66.7%" in printed and "3.00" in printed
    rows = list(csv.DictReader((out / "fake.csv").open()))
    assert float(rows[1]["spec_acceptance_rate"]) == pytest.approx(4 / 6)
    # The plot command's comparison carries the columns too.
    assert main(["plot", str(out / "fake.json"), "--output_dir", str(tmp_path / "p")]) == 0
    md = (tmp_path / "p" / "comparison.md").read_text()
    assert "| draft acceptance | mean acceptance length |" in md and "| 66.7% | 3.00 |" in md


@pytest.mark.parametrize("metrics", [False, True])
def test_cli_without_spec_counters_omits_the_columns(tmp_path, capsys, metrics):
    # No /metrics at all (404), or a /metrics page without speculative counters.
    with FakeOpenAIServer(ttft_s=0.01, itl_s=0.005, metrics=metrics) as srv:
        out, run = _bench(tmp_path, srv)
        assert srv.metrics_scrapes == (2 if metrics else 0)  # no second scrape per rate
    assert all("spec_decode" not in e for e in run["rates"])
    printed = capsys.readouterr().out
    assert "accept" not in printed and "acc len" not in printed
    assert not any(k.startswith("spec_") for k in
                   next(csv.DictReader((out / "fake.csv").open())))


@pytest.mark.parametrize("names", ["both", "vllm", "bladellm"])
def test_reads_bladellm_servers_own_metrics_page(names):
    """The contract with bladellm/entrypoints/openai/metrics.py: whatever --metrics_names, the
    bench finds the server's counters, once."""
    from bladellm.core.outputs import SchedulerStats
    from bladellm.entrypoints.openai.metrics import PrometheusStatLogger

    logger = PrometheusStatLogger(model_name="/models/demo", names=names)
    before = spec_counters(_text(logger.render()))
    logger.update_scheduler_stats(SchedulerStats(num_spec_drafts=5, num_spec_draft_tokens=15,
                                                 num_spec_accepted_tokens=9))
    d = spec_delta(before, spec_counters(_text(logger.render())))
    assert (d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"]) == (5, 15, 9)
    assert d["acceptance_rate"] == pytest.approx(0.6)
    assert d["mean_acceptance_length"] == pytest.approx(2.8)


def _text(page) -> str:
    return page.decode() if isinstance(page, bytes) else page
