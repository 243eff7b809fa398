"""Plot training runs: loss (training and validation), learning rate, grad norm, tokens/s
and MFU against iteration, several runs overlaid, into one PNG.

    python tools/plot_run.py runs/pretrain_tiny_cpu [OTHER_RUN ...] --output run.png

A RUN_DIR is a directory holding ``metrics.jsonl`` (``--metrics-jsonl``) or that file
itself. Needs matplotlib (``pip install -e '.[plot]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

PROG = "plot_run"
PANELS = [  # (title, [(key, label suffix, style)], log y)
    ("loss", [("lm_loss", "train", "-"), ("validation_loss", "valid", "o--")], False),
    ("learning rate", [("lr", "", "-")], False),
    ("grad norm", [("grad_norm", "", "-")], True),
    ("tokens/s", [("tokens_per_sec", "", "-")], False),
    ("MFU", [("mfu", "", "-")], False),
]


class PlotError(ValueError):
    pass


def read_metrics(run: str) -> list[dict]:
    """The rows of a run's metrics.jsonl (later rows of a resumed iteration win)."""
    path = os.path.join(run, "metrics.jsonl") if os.path.isdir(run) else run
    if not os.path.isfile(path):
        raise PlotError(f"{run}: no metrics.jsonl (train with --metrics-jsonl)")
    rows = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise PlotError(f"{path}:{n}: not a JSON line") from None
            if isinstance(row, dict) and isinstance(row.get("iteration"), int):
                rows.setdefault(row["iteration"], {}).update(row)
    if not rows:
        raise PlotError(f"{path}: holds no iteration rows")
    return [rows[i] for i in sorted(rows)]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["iteration"], r[key]) for r in rows
           if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_runs(runs: list[str], output: str, dpi: int = 100) -> int:
    """Write the figure of ``runs`` to ``output``; returns the number of curves drawn."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError("matplotlib is not installed: pip install -e '.[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [os.path.basename(os.path.normpath(r)) or r for r in runs]
    if len(set(names)) < len(names):  # same last component: name them by the whole path
        names = list(runs)
    data = [(name, read_metrics(r)) for name, r in zip(names, runs)]
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(9, 2.6 * len(PANELS)), sharex=True)
    curves = 0
    for ax, (title, keys, log) in zip(axes, PANELS):
        for run, (name, rows) in enumerate(data):
            for k, (key, suffix, style) in enumerate(keys):
                x, y = series(rows, key)
                if x:  # one color per run and key, the same in every panel
                    ax.plot(x, y, style, label=f"{name} {suffix}".strip(), markersize=3,
                            color=f"C{(run * 2 + k) % 10}")
                    curves += 1
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if log and ax.lines:
            ax.set_yscale("log")
        if ax.lines:
            ax.legend(fontsize=7)
    axes[-1].set_xlabel("iteration")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=dpi)
    plt.close(fig)
    return curves


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--output", required=True, help="PNG file to write")
    p.add_argument("--dpi", type=int, default=100, help="resolution (the figure is 9 x 13 in)")
    args = p.parse_args(argv)
    try:
        if args.dpi < 10:
            raise PlotError(f"--dpi must be >= 10, got {args.dpi}")
        curves = plot_runs(args.runs, args.output, args.dpi)
    except (PlotError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output} ({curves} curves from {len(args.runs)} run(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
