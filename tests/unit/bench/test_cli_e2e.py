"""The CLI end to end against a fake streaming server with known token timings."""

import csv
import json

import pytest

from bench_fake_server import FakeOpenAIServer
from bladellm.entrypoints.cli.bench import main

TTFT_S, ITL_S = 0.08, 0.03


@pytest.fixture
def server():
    with FakeOpenAIServer(ttft_s=TTFT_S, itl_s=ITL_S) as srv:
        yield srv


def _run(tmp_path, srv, *extra, input_len: str | None = "4,12"):
    out = tmp_path / "out"
    # A file dataset's prompts are its own: --input_len_range is refused with one.
    lens = ["--input_len_range", input_len] if input_len else []
    argv = ["--base-url", srv.base_url, "--num_prompts", "8", *lens,
            "--output-len-range", "6,6", "--output_dir", str(out), "--label", "fake",
            "--disable_tqdm", *extra]
    assert main(argv) == 0
    return out, json.loads((out / "fake.json").read_text())


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_sweep_measures_known_timings(tmp_path, server, endpoint, capsys):
    out, run = _run(tmp_path, server, "--endpoint", endpoint, "--request_rate", "20,inf",
                    "--num_warmup", "2", "--slo", "ttft:1000,tpot:500", "--ignore_eos",
                    "--eos_logit_bias", "2")
    assert run["model"] == "fake-model"  # found at /v1/models
    assert [e["request_rate"] for e in run["rates"]] == ["20", "inf"]
    assert len(server.payloads) == 2 + 8 + 8  # warm-up sent, but not measured
    for e in run["rates"]:
        assert e["completed"] == 8 and e["errors"] == 0 and e["usage_reported"]
        assert e["total_output_tokens"] == 48
        # asyncio.sleep never wakes early; on a loaded 2-core box it can wake late.
        assert TTFT_S * 1000 - 2 <= e["ttft_ms"]["p50"] <= TTFT_S * 1000 + 60
        assert ITL_S * 1000 - 3 <= e["itl_ms"]["p50"] <= ITL_S * 1000 + 20
        assert ITL_S * 1000 - 3 <= e["tpot_ms"]["mean"] <= ITL_S * 1000 + 20
        expected_e2e = (TTFT_S + 5 * ITL_S) * 1000
        assert expected_e2e - 3 <= e["e2e_ms"]["p50"] <= expected_e2e + 80
        assert e["goodput"] == pytest.approx(e["request_throughput"])
        assert len(e["requests"]) == 8 and all(len(r["itl"]) == 5 for r in e["requests"])
    # rate 20 spreads 8 arrivals over ~0.35 s; inf sends them together.
    assert run["rates"][1]["request_throughput"] > run["rates"][0]["request_throughput"]
    assert server.max_in_flight == 8
    body = server.payloads[-1]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["logit_bias"] == {"2": -100}
    assert body["max_tokens"] == 6
    rows = list(csv.DictReader((out / "fake.csv").open()))
    assert [r["request_rate"] for r in rows] == ["20", "inf"]
    assert float(rows[0]["ttft_p50_ms"]) == pytest.approx(run["rates"][0]["ttft_ms"]["p50"])
    for name in ("fake_ttft_vs_qps.png", "fake_tbt_vs_qps.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "TTFT mean/p50/p90/p99" in table and "max rate meeting the SLO: inf" in table


def test_errors_are_recorded_not_fatal(tmp_path, server):
    data = tmp_path / "p.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p, "output_len": 4}) for p in
                              ["ok one", "please FAIL_HTTP", "then FAIL_STREAM", "ok two"]))
    _, run = _run(tmp_path, server, "--dataset", f"jsonl:{data}", "--max_concurrency", "2",
                  "--request_rate", "inf", input_len=None)
    e = run["rates"][0]
    assert e["errors"] > 0 and e["completed"] > 0 and e["completed"] + e["errors"] == 8
    assert any("HTTP 500" in s for s in e["error_samples"])
    assert "injected stream error" in e["error_samples"]
    assert server.max_in_flight <= 2


def test_counts_chunks_when_server_reports_no_usage(tmp_path):
    with FakeOpenAIServer(ttft_s=0.01, itl_s=0.005, usage=False) as srv:
        _, run = _run(tmp_path, srv, "--model", "m", "--request_rate", "inf")
    e = run["rates"][0]
    assert not e["usage_reported"] and e["total_output_tokens"] == 48


def test_plot_command_compares_servers(tmp_path, server, capsys):
    out, run = _run(tmp_path, server, "--request_rate", "10,inf", "--slo", "ttft:1000")
    other = dict(run, label="slower")
    for e in other["rates"]:
        e["ttft_ms"] = {k: v * 3 for k, v in e["ttft_ms"].items()}
    (out / "slower.json").write_text(json.dumps(other))
    plots = tmp_path / "plots"
    assert main(["plot", str(out / "fake.json"), str(out / "slower.json"),
                 "--output-dir", str(plots), "--slo", "ttft:1", "--labels", "A,B"]) == 0
    assert sorted(p.name for p in plots.iterdir()) == [
        "comparison.md", "tbt_vs_qps.png", "ttft_vs_qps.png"]
    printed = capsys.readouterr().out
    # Re-judged under a 1 ms TTFT target no rate passes.
    assert "A: max rate meeting SLO: none" in printed
    # One Markdown row per (rate, server), rates in sweep order, servers in file order.
    table = (plots / "comparison.md").read_text().splitlines()
    rows = [line.split(" | ")[:2] for line in table[2:] if line.startswith("| ")]
    assert rows == [["| 10", "A"], ["| 10", "B"], ["| inf", "A"], ["| inf", "B"]]
    assert table[-1] == ("Highest achieved rate with 90% of requests meeting the SLO: "
                         "A none, B none.")


def test_bad_flag_names_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--request_rate", "0", "--model", "m", "--output_dir", str(tmp_path)])
    assert "--request_rate" in capsys.readouterr().err


def test_help_documents_every_option_and_the_plot_subcommand(capsys):
    """Issue 15 item 12: defaults shown, every option documented, `plot` listed."""
    import pytest

    from bladellm.entrypoints.cli.bench import build_plot_parser, build_run_parser, main

    for parser in (build_run_parser(), build_plot_parser()):
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, action.option_strings
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "blade_llm_bench plot FILE.json" in out and "subcommands:" in out
    assert "(default: 128,128)" in out and "(default: http://127.0.0.1:8081)" in out
    with pytest.raises(SystemExit):
        main(["plot", "--help"])
    assert "(default: mean)" in capsys.readouterr().out


# Every option is checked before any server is contacted: the URL below refuses connections, so
# a check that came later would end in "cannot list models" (exit message), not in a usage error.
@pytest.mark.parametrize("extra,flag", [
    (["--num_groups", "8"], "--num_groups"),  # shared_prefix knob with --dataset random
    (["--prefix_len", "64"], "--prefix_len"),
    (["--dataset", "jsonl:" + __file__, "--num_groups", "2"], "--num_groups"),  # file exists
    (["--dataset", "shared_prefix", "--num_groups", "0"], "--num_groups"),
    (["--dataset", "shared_prefix", "--prefix_len", "0"], "--prefix_len"),
    (["--dataset", "nope"], "--dataset"),
    (["--dataset", "random:extra"], "--dataset"),
    (["--dataset", "jsonl"], "--dataset"),
    (["--dataset", "sharegpt:/nonexistent/sharegpt.json"], "--dataset"),
    (["--slo_target", "0"], "--slo_target"),
    (["--slo_target", "1.5"], "--slo_target"),
    (["--slo_target", "nan"], "--slo_target"),
    (["--request_timeout", "0"], "--request_timeout"),
    (["--request_timeout", "-1"], "--request_timeout"),
    (["--request_timeout", "inf"], "--request_timeout"),
    (["--burstiness", "nan"], "--burstiness"),
    # Values that were accepted and then ignored, or sent to make every request fail:
    (["--request_rate", "nan"], "--request_rate"),  # ran at once, like inf, labelled "nan"
    (["--request_rate", "1,nan"], "--request_rate"),
    (["--slo", "ttft:nan"], "--slo"),  # every request "met" a NaN target
    (["--slo", "tpot:inf"], "--slo"),
    (["--slo", "ttft:500,ttft:100"], "--slo"),  # the last one silently won
    (["--slo", "e2e:500,e2el:100"], "--slo"),
    (["--eos_logit_bias", "abc"], "--eos_logit_bias"),  # the error named no flag
    (["--eos_logit_bias=-5"], "--eos_logit_bias"),  # every request got HTTP 400
    (["--temperature", "nan"], "--temperature"),
    (["--temperature=-1"], "--temperature"),
    (["--slo_target", "0.5"], "--slo_target"),  # without --slo: nothing to judge
    (["--burstiness", "0.5"], "--burstiness"),  # only rate inf: no gaps to shape
    (["--burstiness", "2", "--request_rate", "inf,inf"], "--burstiness"),
    (["--dataset", "jsonl:" + __file__, "--input_len_range", "8,16"], "--input_len_range"),
])
def test_bad_options_fail_before_contacting_the_server(tmp_path, capsys, extra, flag):
    with pytest.raises(SystemExit) as exc:
        main(["--base_url", "http://127.0.0.1:9", "--output_dir", str(tmp_path / "out"),
              "--disable_tqdm", *extra])
    assert exc.value.code == 2  # argparse usage error, not the connection failure
    err = capsys.readouterr().err
    assert f"error: {flag}" in err  # the usage line lists every flag: match the error
    assert not (tmp_path / "out").exists()


def test_shared_prefix_knobs_accepted_with_shared_prefix(tmp_path, server):
    _, run = _run(tmp_path, server, "--dataset", "shared_prefix", "--num_groups", "2",
                  "--prefix_len", "8", "--slo", "ttft:1000", "--slo_target", "1",
                  "--request_timeout", "30")
    assert run["dataset"] == "shared_prefix" and run["args"]["num_groups"] == 2


def test_plot_slo_target_is_checked(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plot", str(tmp_path / "x.json"), "--slo_target", "2"])
    assert exc.value.code == 2 and "error: --slo_target" in capsys.readouterr().err


def test_knobs_that_take_effect_are_accepted(tmp_path, server):
    """The other side of the checks above: each knob where it does something."""
    _, run = _run(tmp_path, server, "--slo", "ttft:1000", "--slo_target", "0.5",
                  "--burstiness", "0.5", "--request_rate", "50,inf", "--temperature", "0.7",
                  "--eos_logit_bias", "0,2")
    assert run["slo_target"] == 0.5 and [e["completed"] for e in run["rates"]] == [8, 8]
    assert server.payloads[-1]["temperature"] == 0.7
    assert server.payloads[-1]["logit_bias"] == {"0": -100, "2": -100}


def test_unusable_output_dir_or_tokenizer_fail_before_the_sweep(tmp_path, capsys):
    """Both were found only after contacting the server: an output dir that can't be made
    ended the run in a traceback after the whole sweep had run, its results lost; a missing
    tokenizer path in a Hugging Face traceback."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for extra, flag in [(["--output_dir", str(blocker / "out")], "--output_dir"),
                        (["--output_dir", str(blocker)], "--output_dir"),
                        (["--tokenizer", str(tmp_path / "no_such_tokenizer")], "--tokenizer")]:
        with pytest.raises(SystemExit) as exc:
            main(["--base_url", "http://127.0.0.1:9", "--model", "m", "--disable_tqdm",
                  "--output_dir", str(tmp_path / "out"), *extra])
        assert exc.value.code == 2, extra  # a usage error, not the connection failure
        assert f"error: {flag}" in capsys.readouterr().err


def test_a_run_where_every_request_failed_says_why_and_exits_1(tmp_path, server, capsys):
    """A wrong --model, an unreachable server or a refused parameter made every request fail:
    the run exited 0 and, with --disable_tqdm, the cause was only in the JSON."""
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "always FAIL_HTTP", "output_len": 4}))
    out = tmp_path / "out"
    assert main(["--base_url", server.base_url, "--model", "m", "--dataset", f"jsonl:{data}",
                 "--num_prompts", "3", "--output_dir", str(out), "--label", "x",
                 "--disable_tqdm"]) == 1
    err = capsys.readouterr().err
    assert "rate inf: 3 of 3 requests failed" in err and "HTTP 500" in err
    assert "every request failed" in err
    assert json.loads((out / "x.json").read_text())["rates"][0]["errors"] == 3  # still written


def test_a_timed_out_request_names_request_timeout(tmp_path, capsys):
    with FakeOpenAIServer(ttft_s=2.0, itl_s=0.01) as srv:
        assert main(["--base_url", srv.base_url, "--model", "m", "--num_prompts", "1",
                     "--input_len_range", "4", "--output_len_range", "2", "--disable_tqdm",
                     "--request_timeout", "0.3", "--output_dir", str(tmp_path),
                     "--label", "t"]) == 1
    run = json.loads((tmp_path / "t.json").read_text())
    assert run["rates"][0]["error_samples"] == [
        "TimeoutError: no complete response within --request_timeout (0.3 s)"]
    assert "--request_timeout" in capsys.readouterr().err


def test_ctrl_c_keeps_the_rates_already_measured(tmp_path, server):
    """Ctrl-C during the second rate was a traceback and no file: the first rate's results
    were lost. Now they are written, marked interrupted, and the exit status is 130."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    proc = subprocess.Popen(
        [sys.executable, "-m", "bladellm.entrypoints.cli.bench", "--base_url", server.base_url,
         "--model", "m", "--num_prompts", "4", "--input_len_range", "4",
         "--output_len_range", "2", "--request_rate", "100,0.2", "--output_dir",
         str(tmp_path), "--label", "c"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
        text=True, env={**os.environ, "PYTHONPATH": repo}, cwd=repo)
    first_done = threading.Event()
    err: list[str] = []

    def drain() -> None:
        for line in iter(proc.stderr.readline, ""):
            err.append(line)
            if "rate 100:" in line:
                first_done.set()
        first_done.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    assert first_done.wait(120)
    time.sleep(0.5)  # inside rate 0.2's schedule (its 4 arrivals span ~15 s)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    reader.join(10)  # the only reader of stderr: every line is in err
    assert proc.returncode == 130, "".join(err)[-2000:]
    run = json.loads((tmp_path / "c.json").read_text())
    assert run["interrupted"] is True
    assert [e["request_rate"] for e in run["rates"]] == ["100"]
    assert run["rates"][0]["completed"] == 4
    assert "interrupted" in "".join(err) and (tmp_path / "c.csv").exists()


class _WordTokenizer:
    """One token per whitespace-separated word (the fake server's words)."""

    def encode(self, text, add_special_tokens=True):
        return list(range(len(text.split())))

    def decode(self, ids):
        return " ".join("w" for _ in ids)

    def __len__(self):
        return 4


def test_without_usage_a_tokenizer_counts_the_tokens_of_packed_chunks(tmp_path, monkeypatch):
    """A server that packs several tokens into a chunk (BladeLLM does: 9 tokens in 5 chunks on
    a tiny model) and reports no usage: the count was the chunks (54 tokens for 96 on a real
    run with --no_usage), so TPOT and output throughput were off even with --tokenizer. vLLM
    tokenizes the generated text; so do we when a tokenizer is given."""
    import bladellm.entrypoints.cli.bench as bench_cli

    monkeypatch.setattr(bench_cli, "load_tokenizer", lambda path: _WordTokenizer())
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "a b c"}))  # (a jsonl only counts prompt tokens)
    with FakeOpenAIServer(ttft_s=0.01, itl_s=0.002, usage=False, tokens_per_chunk=3) as srv:
        _, run = _run(tmp_path, srv, "--model", "m", "--request_rate", "inf",
                      "--tokenizer", str(tmp_path), "--dataset", f"jsonl:{data}",
                      input_len=None)
        e = run["rates"][0]
        assert not e["usage_reported"] and e["total_output_tokens"] == 8 * 6
        assert all(len(r["itl"]) == 1 for r in e["requests"])  # ITL stays per chunk (2 each)
        assert "generated_text" not in e["requests"][0]  # counted, not stored
        _, run = _run(tmp_path, srv, "--model", "m", "--request_rate", "inf")
        assert run["rates"][0]["total_output_tokens"] == 8 * 2  # no tokenizer: chunks


@pytest.mark.parametrize("name,text", [
    ("s.json", '{"not": "a list"}'),  # was AttributeError: 'str' object has no attribute 'get'
    ("s.json", "[1, 2]"),
    ("s.json", "{broken"),
    ("p.jsonl", '{"prompt": "a"}\n{broken\n'),  # was a JSONDecodeError traceback
    ("p.jsonl", '{"prompt": "a", "output_len": "many"}'),
    ("p.jsonl", '{"prompt": "a", "output_len": 0}'),  # max_tokens 0: HTTP 400 on every request
    ("p.jsonl", '["prompt"]'),
])
def test_a_malformed_dataset_file_is_one_error_naming_it(tmp_path, server, name, text):
    path = tmp_path / name
    path.write_text(text)
    kind = "sharegpt" if name.endswith(".json") else "jsonl"
    with pytest.raises(SystemExit) as exc:
        _run(tmp_path, server, "--dataset", f"{kind}:{path}", input_len=None)
    assert str(exc.value.code).startswith(f"blade_llm_bench: --dataset {kind}:{path}")
    assert server.payloads == []  # nothing sent
