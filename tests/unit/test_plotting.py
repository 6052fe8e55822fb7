"""experiments/plotting.py redraws an experiment's figure from a saved CSV alone, run as a user runs
it (``python -m experiments.plotting CSV``, a real process): every CSV gives a real PNG next to it,
and a CSV it cannot draw gives an error that names the file and the problem, and no PNG."""
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

GOOD = {
    # Shapes of the CSVs the experiments write (the columns they read, a few rows).
    "bench_overhead.csv": "model,mode,config,median_step_ms,p25_step_ms\n"
                          "quick,interleaved,plain,10.0,9\nquick,interleaved,lowdiff-topk,10.4,10\n"
                          "quick,block,full-stall,,\n",
    "bench_recovery.csv": "method,chain,seconds,bytes\nresume step=0,0,0.5,1\nresume step=50,50,1.0,1\n"
                          "naive (torch.save/load),50,3.0,1\nlower bound (read at device bw + steps),50,0.8,1\n",
    "storage_tiers.csv": "config,stall_per_ckpt_ms,stall_se_ms\nlocal,3.5,0.2\nstaged,3.9,\n",
    "tune_simulation.csv": "profile,policy,full_every,batch_steps,wasted_h\nsmall/1h,grid,10,1,2.0\n"
                           "small/1h,grid,100,1,1.0\nsmall/1h,grid,10,-,3.0\nsmall/1h,grid,100,-,4.0\n"
                           "small/1h,controller,100,1,1.0\n",
    "bench_write.csv": "size_bytes,method,gb_per_s,ratio_to_memcpy\n67108864,device O_DIRECT QD32,2.0,\n"
                       "268435456,device O_DIRECT QD32,2.1,\n67108864,fastio,1.9,\n268435456,fastio,2.0,\n"
                       "67108864,memcpy (np.copyto),9.0,1.0\n",
    "scale_sweep.csv": "sweep,series,x,y,x_label,y_label\nmtbf,lowdiff,1,90,job MTBF (h),effective %\n"
                       "mtbf,lowdiff,10,98,job MTBF (h),effective %\nmtbf,sync full,1,70,job MTBF (h),effective %\n"
                       "mtbf,sync full,10,90,job MTBF (h),effective %\n",
}


def run_plotting(*args, cwd=REPO):
    env = {**os.environ, "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-m", "experiments.plotting", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's signature and IHDR chunk (a real PNG, not any file)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    length, chunk = struct.unpack(">I4s", data[8:16])
    assert chunk == b"IHDR" and length == 13
    assert data[-12:-8] == b"\x00\x00\x00\x00" and data[-8:-4] == b"IEND", f"{path} is truncated"
    return struct.unpack(">II", data[16:24])


def test_every_kind_is_redrawn_from_its_csv(tmp_path):
    paths = []
    for name, text in GOOD.items():
        (tmp_path / name).write_text(text)
        paths.append(tmp_path / name)
    done = run_plotting(*paths)
    assert done.returncode == 0, done.stderr
    for path in paths:
        png = path.with_suffix(".png")
        assert str(png) in done.stdout
        width, height = png_size(png)
        assert width > 200 and height > 200


def test_output_path_and_kind_override(tmp_path):
    csv_path = tmp_path / "renamed.csv"
    csv_path.write_text(GOOD["bench_recovery.csv"])
    out = tmp_path / "figure.png"
    done = run_plotting(csv_path, "--kind", "recovery", "-o", out)
    assert done.returncode == 0, done.stderr
    png_size(out)
    assert not csv_path.with_suffix(".png").exists()


@pytest.mark.parametrize("text, words", [
    ("", ["empty"]),
    ("config,stall_per_ckpt_ms\n", ["no rows"]),
    ("config,stall_per_ckpt_ms\nlocal,fast\n", ["line 2", "'stall_per_ckpt_ms'", "'fast'", "not a number"]),
    ("config,stall_per_ckpt_ms\nlocal,1.0,7\n", ["line 2", "3 fields", "header has 2"]),
    ("alpha,beta\n1,2\n", ["no figure for columns", "alpha"]),
])
def test_malformed_csv_is_a_clear_error(tmp_path, text, words):
    csv_path = tmp_path / "bad.csv"
    csv_path.write_text(text)
    done = run_plotting(csv_path)
    assert done.returncode == 2
    assert str(csv_path) in done.stderr
    for word in words:
        assert word in done.stderr
    assert not csv_path.with_suffix(".png").exists()


def test_missing_file_and_wrong_kind(tmp_path):
    done = run_plotting(tmp_path / "absent.csv")
    assert done.returncode == 2 and "absent.csv: no such file" in done.stderr
    csv_path = tmp_path / "tiers.csv"
    csv_path.write_text(GOOD["storage_tiers.csv"])
    done = run_plotting(csv_path, "--kind", "recovery")
    assert done.returncode == 2 and "needs the column(s) method, seconds, chain" in done.stderr
