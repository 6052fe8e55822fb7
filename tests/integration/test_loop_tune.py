"""Issue #27, friction: ``python -m lowdiff tune DIR`` recommends settings from the costs a run
measured and kept in DIR's CONTROLLER.json — a run with fixed settings too — and a failure rate;
the run's own settings are a row of the table. ``--stats`` given a CONTROLLER.json says to give
its directory (it said "costs missing"). Fails on the old code (no DIR argument)."""
from __future__ import annotations

import os

import torch

import lowdiff
from lowdiff.cli.main import main


def fixed_run(directory):
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    opt = lowdiff.wrap(torch.optim.Adam(model.parameters()), model, directory, full_every=6, batch_steps=3)
    for _ in range(20):
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.close()


def test_tune_reads_the_costs_a_fixed_run_left_in_its_directory(tmp_path, capsys):
    fixed_run(str(tmp_path))
    assert main(["tune", str(tmp_path), "--failure-rate-per-hour", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "ran with full_every 6, batch_steps 3" in out
    rows = {line[:24].strip(): line for line in out.splitlines()}
    assert "recommended" in rows and "best full-only" in rows
    assert rows["this run's settings"].split()[3:5] == ["6", "3"]


def test_stats_given_a_controller_file_names_the_way(tmp_path, capsys):
    fixed_run(str(tmp_path))
    assert main(["tune", "--stats", os.path.join(tmp_path, "CONTROLLER.json"), "--failure-rate-per-hour", "1"]) == 2
    assert f"is a CONTROLLER.json, not opt.stats(): give its directory (python -m lowdiff tune {tmp_path}" in \
        capsys.readouterr().err


def test_a_directory_without_measurements_is_named(tmp_path, capsys):
    assert main(["tune", str(tmp_path), "--failure-rate-per-hour", "1"]) == 2
    assert "CONTROLLER.json: not found" in capsys.readouterr().err
