"""Figures of the experiments, drawn from their CSVs only, so that a figure can be redrawn from a
saved CSV without rerunning anything:

    python -m experiments.plotting CSV [CSV ...] [--kind KIND] [-o PNG]
    python experiments/plotting.py CSV

The kind of figure is recognised from the CSV's columns (``--kind`` overrides); the PNG is written
next to the CSV (same name, ``.png``) unless ``-o`` says otherwise. Each experiment calls
``draw(csv_path)`` after writing its CSV. A CSV that is empty, lacks the columns of its kind or
holds a value that is not a number where a number belongs raises ``PlotError`` naming the file,
the line and the column. matplotlib (the ``test`` extra) draws with its Agg backend: no display.
"""
from __future__ import annotations

import argparse
import csv
import math
import sys
from collections.abc import Callable
from pathlib import Path


class PlotError(ValueError):
    """A CSV this module cannot draw: the message names the file and what is wrong."""


Rows = list[dict[str, str]]


class Table:
    """The rows of one CSV, with typed access that names the file, line and column on bad input."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                self.columns = list(reader.fieldnames or [])
                self.rows: Rows = list(reader)
        except FileNotFoundError:
            raise PlotError(f"{path}: no such file") from None
        except (csv.Error, UnicodeDecodeError) as e:
            raise PlotError(f"{path}: not a readable CSV ({e})") from None
        if not self.columns:
            raise PlotError(f"{path}: empty (no header line)")
        if not self.rows:
            raise PlotError(f"{path}: a header but no rows")
        self._lines = {id(row): index + 2 for index, row in enumerate(self.rows)}   # for messages
        for index, row in enumerate(self.rows):
            if None in row:   # csv.DictReader files surplus fields under the key None
                raise PlotError(f"{path}, line {index + 2}: {len(self.columns) + len(row[None])} fields, the header "
                                f"has {len(self.columns)}")

    def number(self, row: dict[str, str], column: str) -> float:
        """``row[column]`` as a float; PlotError if it is missing or not a number."""
        text = row.get(column)
        try:
            if text is None or text.strip() == "":
                raise ValueError
            return float(text)
        except ValueError:
            line = self._lines.get(id(row), "?")
            raise PlotError(f"{self.path}, line {line}: column {column!r} is {text!r}, not a number") from None

    def numbers(self, row: dict[str, str], column: str) -> float | None:
        """Like ``number``, but an empty cell is None (a value the experiment did not measure)."""
        text = row.get(column)
        return None if text is None or text.strip() == "" else self.number(row, column)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


# ------------------------------------------------------------------------------------ the figures
def step_time(t: Table, ax) -> None:
    """Step time per configuration (bench_overhead, bench_replica), the no-checkpoint baseline as a
    vertical line: the overhead is the bar beyond the line."""
    column = next(c for c in ("median_step_ms", "median_ms") if c in t.columns)
    rows = [r for r in t.rows if t.numbers(r, column) is not None]
    if not rows:
        raise PlotError(f"{t.path}: no row has a value in {column!r}")
    modes = {r.get("mode", "") for r in rows}
    labels = [r["config"] + (f" ({r['mode']})" if len(modes) > 1 else "") for r in rows]
    values = [t.number(r, column) for r in rows]
    ax.barh(labels, values, color="tab:blue")
    ax.invert_yaxis()
    baselines = [(lbl, v) for (lbl, v, r) in zip(labels, values, rows) if r["config"] == "plain"]
    for n, (lbl, v) in enumerate(baselines):
        ax.axvline(v, color="black", linestyle="--" if n == 0 else ":", label=f"no checkpointing: {lbl}")
    ax.set(xlabel="step time (ms, median)", title="step time per configuration")
    if baselines:
        ax.legend(loc="lower right")


def recovery(t: Table, ax) -> None:
    """Recovery time against chain length (bench_recovery): resume at each length, naive and the
    lower bound at the length they were measured at."""
    families = {"resume": "tab:blue", "naive": "tab:red", "lower bound": "black"}
    drawn = False
    for family, color in families.items():
        pts = sorted((t.number(r, "chain"), t.number(r, "seconds")) for r in t.rows
                     if r["method"].startswith(family) and t.numbers(r, "chain") is not None)
        if pts:
            ax.plot(*zip(*pts), marker="o", color=color, label=family, linestyle="-" if len(pts) > 1 else "none")
            drawn = True
    if not drawn:
        raise PlotError(f"{t.path}: no row with a chain length and a method resume/naive/lower bound")
    ax.set(xlabel="differentials replayed (chain length)", ylabel="recovery time (s)",
           title="recovery time vs chain length")
    ax.set_ylim(bottom=0)
    ax.legend()


def tiers(t: Table, ax) -> None:
    """Stall per full checkpoint for each storage-tier configuration (storage_tiers), with its
    standard error."""
    names = [r["config"] for r in t.rows]
    stall = [t.number(r, "stall_per_ckpt_ms") for r in t.rows]
    err = [t.numbers(r, "stall_se_ms") or 0.0 for r in t.rows]
    ax.bar(names, stall, yerr=err, capsize=4, color="tab:blue")
    ax.set(ylabel="training stall per full checkpoint (ms)", title="stall per checkpoint by tier")
    if min(stall) > 0 and max(stall) > 20 * min(stall):   # straight-to-slow beside milliseconds: log scale
        ax.set_yscale("log")
    ax.tick_params(axis="x", rotation=20)


def storage(t: Table, ax) -> None:
    """Bytes in each tier over the steps (storage_tiers' retention run)."""
    steps = [t.number(r, "step") for r in t.rows]
    for column in t.columns[1:]:
        ax.plot(steps, [t.number(r, column) / 1e6 for r in t.rows], linestyle="--" if "shared" in column else "-",
                label=column.replace("_bytes", "").replace("_", " "))
    ax.set(xlabel="step", ylabel="checkpoint bytes (MB)", title="storage held per tier")
    ax.legend()


def tune(t: Table, fig) -> None:
    """Simulated wasted time against full_every, one line per batch size, the controller's choice
    marked (tune_frequency's simulation), one panel per profile."""
    profiles = list(dict.fromkeys(r["profile"] for r in t.rows))
    cols = min(4, len(profiles))
    rows_n = math.ceil(len(profiles) / cols)
    fig.set_size_inches(4.2 * cols, 3.3 * rows_n)
    for i, profile in enumerate(profiles):
        ax = fig.add_subplot(rows_n, cols, i + 1)
        mine = [r for r in t.rows if r["profile"] == profile]
        for b in dict.fromkeys(r["batch_steps"] for r in mine if r["policy"] == "grid"):
            pts = sorted((t.number(r, "full_every"), t.number(r, "wasted_h")) for r in mine
                         if r["policy"] == "grid" and r["batch_steps"] == b)
            ax.plot(*zip(*pts), marker=".", label="full only" if b in ("-", "") else f"B={b}")
        for policy, style in (("controller", "k*"), ("young-daly-full", "rv"), ("checkfreq-full", "g^")):
            for r in mine:
                if r["policy"] == policy:
                    ax.plot([t.number(r, "full_every")], [t.number(r, "wasted_h")], style, markersize=11,
                            label=f"{policy} ({r['full_every']}/{r['batch_steps']})")
        log_y = all(t.number(r, "wasted_h") > 0 for r in mine)   # the grid spans decades
        ax.set(xscale="log", yscale="log" if log_y else "linear", xlabel="full_every (steps)",
               ylabel="wasted hours", title=profile)
        ax.legend(fontsize=6)


def goodput(t: Table, ax) -> None:
    """Goodput of the real kill runs (tune_frequency), per setting; several rounds: one bar each."""
    settings = list(dict.fromkeys(r["settings"] for r in t.rows))
    rounds = list(dict.fromkeys(r.get("round", "0") for r in t.rows))
    width = 0.8 / len(rounds)
    for k, rnd in enumerate(rounds):
        values = [next((t.number(r, "goodput_steps_per_s") for r in t.rows
                        if r["settings"] == s and r.get("round", "0") == rnd), 0.0) for s in settings]
        ax.bar([i + k * width for i in range(len(settings))], values, width, label=f"round {rnd}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(settings))], settings)
    ax.set(ylabel="durable steps per wall-clock second", title="goodput under SIGKILLs")
    if len(rounds) > 1:
        ax.legend()


def write_bandwidth(t: Table, ax) -> None:
    """Write bandwidth against size per method (bench_write), the device limit as a dashed line."""
    rows = [r for r in t.rows if not (r.get("ratio_to_memcpy") or "").strip()]   # the copy rows: another question
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = sorted((t.number(r, "size_bytes") / 2**20, t.number(r, "gb_per_s"))
                     for r in rows if r["method"] == method)
        device = method.startswith("device")
        ax.plot(*zip(*pts), marker="o", color="black" if device else None, linestyle="--" if device else "-",
                label=f"{method} (device limit)" if device else method)
    ax.set(xscale="log", xlabel="checkpoint size (MiB)", ylabel="write bandwidth (GB/s)",
           title="write bandwidth vs the device limit")
    sizes = sorted({t.number(r, "size_bytes") / 2**20 for r in rows})
    ax.minorticks_off()
    ax.set_xticks(sizes, [f"{s:g}" for s in sizes])
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)


def distributed_write(t: Table, ax) -> None:
    """Aggregate write bandwidth per layout and rank count (bench_distributed), the device limit of
    one writer as a dashed line."""
    rows = [r for r in t.rows if not r["layout"].startswith("step_")]
    labels = [f"{r['layout']} x{r['ranks']}" for r in rows]
    values = [t.number(r, "bytes_per_s") / 1e9 for r in rows]
    limits = [v / t.number(r, "x_device") for v, r in zip(values, rows) if t.numbers(r, "x_device")]
    ax.barh(labels, values, color="tab:blue")
    ax.invert_yaxis()
    if limits:
        ax.axvline(max(limits), color="black", linestyle="--", label="device limit")
        ax.legend(loc="lower right")
    ax.set(xlabel="write bandwidth (GB/s)", title="full-checkpoint write bandwidth per layout")


def stripe_bandwidth(t: Table, ax) -> None:
    """Striped full-checkpoint write and read bandwidth against the number of drives (bench_stripe),
    the sum of the drives' limits measured alone as dashed lines."""
    n = [t.number(r, "n_devices") for r in t.rows]
    for op, color in (("write", "tab:blue"), ("read", "tab:orange")):
        ax.plot(n, [t.number(r, f"{op}_bytes_per_s") / 1e6 for r in t.rows], marker="o", color=color,
                label=f"striped {op}")
        ax.plot(n, [t.number(r, f"{op}_sum_limits_bytes_per_s") / 1e6 for r in t.rows], linestyle="--",
                color=color, label=f"sum of the drives' {op} limits")
    ax.set_xticks(n, [f"{v:g}" for v in n])
    ax.set(xlabel="drives", ylabel="MB/s", title="striped full checkpoint vs the sum of the drives")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)


def roundtrip(t: Table, ax) -> None:
    """Exact or diverging, per data-loader configuration and check (stateful_dataloader_roundtrip)."""
    checks = [c for c in ("order", "aug", "rng") if c in t.columns]
    labels = [f"{r['config']} w={r['workers']}" for r in t.rows]
    grid = [[1.0 if r[c] == "exact" else 0.0 for c in checks] for r in t.rows]
    ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(checks)), checks)
    ax.set_yticks(range(len(labels)), labels)
    for i, r in enumerate(t.rows):
        for j, c in enumerate(checks):
            ax.text(j, i, r[c], ha="center", va="center", fontsize=7, color="white")
    ax.set_title("resumed data order vs uninterrupted")


def sweep(t: Table, fig) -> None:
    """A quantity against a swept parameter, one line per series, one panel per sweep (the scale
    model: effective training time against failure rate and against storage bandwidth)."""
    panels = list(dict.fromkeys(r["sweep"] for r in t.rows))
    fig.set_size_inches(6 * len(panels), 4.2)
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        mine = [r for r in t.rows if r["sweep"] == panel]
        for series in dict.fromkeys(r["series"] for r in mine):
            pts = sorted((t.number(r, "x"), t.number(r, "y")) for r in mine if r["series"] == series)
            ax.plot(*zip(*pts), marker=".", label=series)
        ax.set(xscale="log", xlabel=mine[0].get("x_label") or panel, ylabel=mine[0].get("y_label") or "y",
               title=mine[0].get("title") or panel)
        ax.legend(fontsize=7)


def predicted_vs_measured(t: Table, ax) -> None:
    """Predicted against measured goodput per setting (the scale model's validation)."""
    rounds = {r.get("round", "") for r in t.rows}
    names = [r["settings"] + (f"\nround {r['round']}" if len(rounds) > 1 else "") for r in t.rows]
    measured = [t.number(r, "measured_goodput") for r in t.rows]
    predicted = [t.number(r, "predicted_goodput") for r in t.rows]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], measured, 0.4, label="measured")
    ax.bar([i + 0.2 for i in x], predicted, 0.4, label="model")
    ax.set_xticks(list(x), names)
    ax.set(ylabel="durable steps per second", title="goodput: the model vs SIGKILL runs")
    ax.legend()


# Recognised by their columns, first match wins (so the more specific kinds come first).
AxesDraw = Callable[[Table, object], None]
KINDS: dict[str, tuple[tuple[str, ...], AxesDraw, bool]] = {
    # kind: (required columns, draw, whether it draws on the figure rather than one axes)
    "tiers": (("config", "stall_per_ckpt_ms"), tiers, False),
    "storage": (("step", "clean_local_bytes"), storage, False),
    "tune": (("profile", "policy", "full_every", "batch_steps", "wasted_h"), tune, True),
    "validation": (("settings", "measured_goodput", "predicted_goodput"), predicted_vs_measured, False),
    "goodput": (("settings", "goodput_steps_per_s"), goodput, False),
    "recovery": (("method", "seconds", "chain"), recovery, False),
    "write_bandwidth": (("size_bytes", "method", "gb_per_s"), write_bandwidth, False),
    "distributed_write": (("layout", "ranks", "bytes_per_s"), distributed_write, False),
    "stripe": (("n_devices", "write_bytes_per_s", "read_bytes_per_s"), stripe_bandwidth, False),
    "step_time_overhead": (("config", "median_step_ms"), step_time, False),
    "step_time": (("config", "median_ms"), step_time, False),
    "roundtrip": (("config", "workers", "order"), roundtrip, False),
    "sweep": (("sweep", "series", "x", "y"), sweep, True),
}


def kind_of(t: Table) -> str:
    """The first kind whose columns the CSV has."""
    for kind, (columns, _, _) in KINDS.items():
        if set(columns) <= set(t.columns):
            return kind
    raise PlotError(f"{t.path}: no figure for columns {t.columns}; expected the columns of one of: " +
                    "; ".join(f"{k} ({', '.join(c)})" for k, (c, _, _) in KINDS.items()))


def draw(csv_path: str | Path, png_path: str | Path | None = None, kind: str | None = None) -> Path:
    """Draw the figure of ``csv_path`` into ``png_path`` (default: the CSV's name with .png) and
    return that path. Raises PlotError for a CSV it cannot draw (nothing is written then)."""
    t = Table(Path(csv_path))
    if kind is None:
        kind = kind_of(t)
    elif kind not in KINDS:
        raise PlotError(f"unknown kind {kind!r}: one of {', '.join(KINDS)}")
    columns, fn, whole_figure = KINDS[kind]
    missing = [c for c in columns if c not in t.columns]
    if missing:
        raise PlotError(f"{t.path}: a {kind} figure needs the column(s) {', '.join(missing)}; the CSV has "
                        f"{', '.join(t.columns)}")
    out = Path(png_path) if png_path is not None else t.path.with_suffix(".png")
    plt = _pyplot()
    fig = plt.figure(figsize=(7.5, 4.5))
    try:
        try:
            fn(t, fig if whole_figure else fig.add_subplot(1, 1, 1))
        except KeyError as e:   # a row without a value in a column the figure reads
            raise PlotError(f"{t.path}: a {kind} figure needs column {e.args[0]!r} in every row") from None
        fig.tight_layout()
        fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return out


def try_draw(csv_path: str | Path, png_path: str | Path | None = None, kind: str | None = None) -> str:
    """``draw`` for an experiment's last line: the PNG written, or why none was (matplotlib is an
    optional dependency; a figure must never cost the measurement it draws)."""
    try:
        return f"figure: {draw(csv_path, png_path, kind)}"
    except ImportError:
        return "(matplotlib is not installed: no figure; pip install -e '.[test]')"
    except PlotError as e:
        return f"(no figure: {e})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.plotting", description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", nargs="+", help="CSV(s) an experiment wrote")
    parser.add_argument("--kind", choices=sorted(KINDS), help="the figure (default: recognised from the columns)")
    parser.add_argument("-o", "--output", help="the PNG (one CSV only; default: next to the CSV)")
    args = parser.parse_args(argv)
    if args.output and len(args.csv) > 1:
        parser.error("-o takes one CSV")
    status = 0
    for path in args.csv:
        try:
            print(draw(path, args.output, args.kind))
        except PlotError as e:
            print(f"error: {e}", file=sys.stderr)
            status = 2
    return status


if __name__ == "__main__":
    sys.exit(main())
