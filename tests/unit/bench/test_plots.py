"""bladellm.bench.plots: TTFT on a log axis, TBT linear unless it spans over a decade."""

import matplotlib.pyplot as plt

from bladellm.bench.metrics import SLO
from bladellm.bench.plots import make_figures, plot_runs, y_scale


def _run(label, ttfts, itls):
    rates = []
    for rate, ttft, itl in zip(("1", "2", "inf"), ttfts, itls):
        rates.append({"request_rate": rate, "request_throughput": float(len(rates) + 1),
                      "completed": 8, "num_requests": 8, "errors": 0,
                      "ttft_ms": {"mean": ttft}, "itl_ms": {"mean": itl}})
    return {"label": label, "rates": rates}


def _scales(runs):
    figs = make_figures(runs, slo=SLO(ttft=1000.0, tpot=100.0))
    try:
        return {name: fig.axes[0].get_yscale() for name, fig in figs}
    finally:
        for _, fig in figs:
            plt.close(fig)


def test_ttft_is_log_and_narrow_tbt_linear():
    runs = [_run("a", [120, 180, 2400], [20, 25, 70]), _run("b", [140, 200, 2100], [30, 40, 69])]
    assert _scales(runs) == {"ttft_vs_qps.png": "log", "tbt_vs_qps.png": "linear"}


def test_tbt_goes_log_when_it_spans_over_ten_times():
    runs = [_run("a", [120, 180, 2400], [15, 40, 400])]
    assert _scales(runs)["tbt_vs_qps.png"] == "log"


def test_y_scale_rule():
    assert y_scale("log", [100, 120]) == "log"
    assert y_scale("auto", [10, 100]) == "linear"  # exactly 10x: not over
    assert y_scale("auto", [10, 101]) == "log"
    assert y_scale("log", []) == "linear"          # nothing positive to put on a log axis
    assert y_scale("auto", [0.0, 5.0]) == "linear"


def test_plot_runs_writes_both_files(tmp_path):
    paths = plot_runs([_run("a", [120, 180, 2400], [20, 25, 70])], str(tmp_path), prefix="x_")
    assert [p.rsplit("/", 1)[1] for p in paths] == ["x_ttft_vs_qps.png", "x_tbt_vs_qps.png"]
    assert all((tmp_path / n).stat().st_size > 0 for n in ("x_ttft_vs_qps.png",
                                                           "x_tbt_vs_qps.png"))
