"""sim.reproduce.fit: the search of unstated settings scores every window of consecutive rates
by the six headline figures, computed as the reproduction does, against the paper's."""

from __future__ import annotations

import pandas as pd
import pytest

from sim.reproduce import fit
from sim.reproduce.experiments import PAPER


def tidy(rates, base_ttft, ours_ttft, base_ls, ours_ls, base_be, ours_be, base_tp, ours_tp):
    """A tidy table of one setting, two replicates a rate (equal, so means are the values)."""
    rows = []
    for i, rate in enumerate(rates):
        for rep in (0, 1):
            for policy, ttft, ls, be, tp in (
                ("iteration", base_ttft[i], base_ls[i], base_be[i], base_tp[i]),
                ("qllm", ours_ttft[i], ours_ls[i], ours_be[i], ours_tp[i]),
            ):
                common = {"num_requests": 256, "max_output_tokens": 50, "ls_fraction": 0.2,
                          "rate": rate, "policy": policy, "replicate": rep}  # fmt: skip
                rows += [
                    {**common, "cls": "LS", "ttft_mean_s": ttft, "turnaround_mean_s": ls},
                    {**common, "cls": "BE", "ttft_mean_s": 1.0, "turnaround_mean_s": be},
                    {**common, "cls": "all", "steady_jobs_per_s": tp, "jobs_per_s": tp},
                ]
    return pd.DataFrame(rows)


def test_windows_compute_the_six_figures_and_their_fold_errors():
    # rate 1: TTFT 65.5x lower, LS turnaround 12.8x, BE 1.38x, throughput equal: the paper
    # rate 2: TTFT 101.6x, LS turnaround 2x, BE 2.04x; rate 3: TTFT 29.4x, BE 0.72x
    table = tidy(
        rates=[1.0, 2.0, 3.0, 4.0],
        base_ttft=[65.5, 101.6, 29.4, 1.0], ours_ttft=[1.0, 1.0, 1.0, 1.0],
        base_ls=[12.8, 2.0, 1.0, 1.0], ours_ls=[1.0, 1.0, 1.0, 1.0],
        base_be=[1.0, 1.0, 1.0, 1.0], ours_be=[1.38, 2.04, 0.72, 10.0],
        base_tp=[1.0, 1.0, 1.0, 1.0], ours_tp=[1.0, 1.0, 1.0, 0.1],
    )  # fmt: skip
    w = fit.windows(fit.per_rate(table)).set_index("rates")
    assert set(w.index) == {"1-3", "2-4", "1-4"}  # at least three consecutive rates
    first = w.loc["1-3"]
    assert first["ls_ttft_reduction_avg"] == pytest.approx((65.5 + 101.6 + 29.4) / 3)
    assert first["ls_ttft_reduction_max"] == pytest.approx(101.6)
    assert first["ls_turnaround_reduction_max"] == pytest.approx(12.8)
    assert first["be_turnaround_ratio_avg"] == pytest.approx((1.38 + 2.04 + 0.72) / 3)
    assert first["be_turnaround_ratio_max"] == pytest.approx(2.04)
    assert first["throughput_ratio_avg"] == pytest.approx(1.0)
    assert first["within_2x"] == 6
    # rate 4 (TTFT equal, BE 10x longer, throughput 0.1x) spoils every window holding it
    later = w.loc["2-4"]
    assert later["within_2x"] < 6 and later["worst"] == "ls_turnaround_reduction_max"
    assert later["worst_fold"] == pytest.approx(12.8 / 2.0)
    best = fit.best_per_setting(w.reset_index())
    assert list(best["rates"]) == ["1-3"]
    assert "| 256 | 50 | 0.2 | 1-3 |" in fit.markdown(best)


def test_fold_error_is_symmetric_and_infinite_for_no_value():
    assert fit.fold_error(2.0, 1.0) == fit.fold_error(0.5, 1.0) == 2.0
    assert fit.fold_error(float("nan"), 1.0) == float("inf")
    assert fit.fold_error(0.0, PAPER["throughput_ratio_avg"]) == float("inf")


def test_fit_on_a_table_refuses_the_flags_of_a_search_and_pooled_experiments(tmp_path, capsys):
    """With --table, --num-requests and the other axes were accepted and ignored, and a
    reproduce table's experiments were pooled as one search."""
    path = tmp_path / "table.csv.gz"
    pd.DataFrame({"experiment": ["paper", "uncapped"], "rate": [1.0, 1.0]}).to_csv(path)
    assert fit.main(["--table", str(path), "--num-requests", "60", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("reproduce.fit: error: --num-requests sets up a search to run; with --table "
                   "the table's own settings are analysed")  # fmt: skip
    assert fit.main(["--table", str(path), "--out", str(tmp_path)]) == 2
    assert "holds the runs of 2 experiments (paper, uncapped)" in capsys.readouterr().err
