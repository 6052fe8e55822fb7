"""Swap, flip and truncate campaigns (issue #33, coverage) on a TopK directory and on the shares
of a partitioned directory (damage.py): every damage is reported by ``verify`` (or changed only
padding, and resume is exact at the clean step), and no resume lands on a state other than the
uninterrupted run's. CI runs a few cases per mode; ``campaign.py`` runs more."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integration"))

import damage  # noqa: E402
import partitioned  # noqa: E402
from lowdiff_helpers import reference_digests, resumed_digest, train_directory  # noqa: E402

CASES_PER_MODE = 3
STEPS = 20


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def check_cases(clean, work, resume, clean_step, seed) -> None:
    rng = np.random.default_rng(seed)
    bad = []
    for mode in damage.MODES:
        for _ in range(CASES_PER_MODE):
            case = damage.run_case(clean, work, mode, rng, resume, clean_step)
            if case.outcome == "wrong" or not (case.detected or case.harmless):
                bad.append(case)
    assert not bad, "\n".join(map(str, bad))


def test_damage_to_a_topk_directory(tmp_path):
    reference = reference_digests(STEPS)
    clean = train_directory(str(tmp_path / "clean"), STEPS)

    def resume(directory):
        step, digest = resumed_digest(directory)
        return int(step), digest == reference[int(step)]
    check_cases(clean, str(tmp_path / "work"), resume, STEPS, seed=331)


def test_damage_to_partitioned_shares(tmp_path):
    partitioned.launch(str(tmp_path / "root"), str(tmp_path / "run"), traced=False)
    reference = partitioned.reference_of(str(tmp_path / "run"))

    def resume(directory):
        step, digest = partitioned.resumed_shared_at(directory)
        return step, digest == reference[step]
    check_cases(str(tmp_path / "root" / "ckpt"), str(tmp_path / "work"), resume, partitioned.STEPS, seed=332)
