"""What a ``gc-moe-ab`` run shows and writes: a ``rich`` progress bar and table in the terminal, the JSON result file
and a PNG in the paper's style (latency with the floor, and speedup, against tokens per rank, one line per
operator); and the README's results rows generated from result files::

    python -m gc_moe_compat.ab.report --readme-table bench/results/ab_*.json            # print the rows
    python -m gc_moe_compat.ab.report --readme-table bench/results/ab_*.json --write README.md

``--write`` replaces the rows between the ``<!-- ab-table:begin -->`` and ``<!-- ab-table:end -->`` comments (inline
in the first and the last generated row, so the markdown table stays one table) and nothing else.

``rich`` and ``matplotlib`` are imported when first used. Without ``rich`` (a machine where it is not installed)
the progress and the table are printed as plain lines, with one note saying so; without ``matplotlib`` no PNG is
written, with a note. The measurements never depend on either.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from gc_moe_compat.compute_paths import compute_path

__all__ = ["README_BEGIN", "README_END", "TABLE_WIDTH", "Progress", "main", "plot", "progress", "pyplot",
           "readme_rows", "replace_readme_rows", "table", "table_rows", "write_json"]

README_BEGIN, README_END = "<!-- ab-table:begin -->", "<!-- ab-table:end -->"


def _rich() -> ModuleType | None:
    try:
        import rich  # noqa: F401
    except ImportError:
        return None
    import rich.console
    import rich.progress
    import rich.table

    return rich


def pyplot() -> ModuleType | None:
    """``matplotlib.pyplot`` on the headless Agg backend, or None (with a note) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG written (pip install matplotlib)", file=sys.stderr)
        return None
    return plt


class Progress:
    """One task's progress: :meth:`advance` after each timed (point, operator, round)."""

    def __init__(self, bar: object | None, task: object | None, total: int) -> None:
        self._bar, self._task, self.total, self.done = bar, task, total, 0

    def advance(self, what: str, steps: int = 1) -> None:
        """``steps`` steps done (more than one: an operator left out of its remaining rounds), ``what`` the last."""
        self.done += steps
        if self._bar is not None:
            self._bar.update(self._task, advance=steps, description=what)
        else:
            print(f"[{self.done}/{self.total}] {what}", flush=True)

    def note(self, line: str) -> None:
        """A line printed above the bar."""
        if self._bar is not None:
            self._bar.console.print(line)
        else:
            print(line, flush=True)


@contextmanager
def progress(total: int, enabled: bool = True) -> Iterator[Progress]:
    """A progress bar over ``total`` steps (rank 0 only: ``enabled`` False elsewhere prints nothing)."""
    if not enabled:
        yield Progress(None, None, total)
        return
    rich = _rich()
    if rich is None:
        print("rich not installed: plain progress lines (pip install rich)", file=sys.stderr)
        yield Progress(None, None, total)
        return
    columns = (rich.progress.TextColumn("{task.description}"), rich.progress.BarColumn(),
               rich.progress.MofNCompleteColumn(), rich.progress.TimeElapsedColumn())
    with rich.progress.Progress(*columns) as bar:
        yield Progress(bar, bar.add_task("gc-moe-ab", total=total), total)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


TABLE_WIDTH = 120
"""The terminal table's width at most: one row per (T, operator), so any number of operators fits."""
TABLE_HEADER = ("T", "operator", "µs", "over {ref}", "efficiency", "cosine")
SPREAD_HEADER = "spread %"
"""The column :func:`table_rows` adds where the points were timed in two rounds or more."""


def _has_spread(points: Sequence[Mapping[str, object]]) -> bool:
    """Whether any point was timed in two rounds or more (older files and ``--repeats 1`` runs have no spread)."""
    return any(p.get("spread_pct") for p in points)


def table_rows(points: Sequence[Mapping[str, object]], ops: Sequence[str], reference_op: str) -> list[list[str]]:
    """The table's cells, one row per point and measured operator (in ``ops`` order): T, the operator, its latency
    (µs, slowest rank), its latency over the reference op's (> 1: the reference is faster), its efficiency (the
    floor of its weight format over its latency), its worst cosine against the quantization-faithful reference and,
    where the points carry ``spread_pct`` (two timing rounds or more), its spread between the rounds."""
    spread_column = _has_spread(points)
    rows = []
    for p in points:
        lat, sp, eff = p["latency_us"], p["speedup"], p["efficiency"]
        for op in ops:
            if op not in lat:
                continue
            ratio = "1" if op == reference_op else _fmt(sp.get(f"{op}_over_{reference_op}"), ".2f")
            acc = p["accuracy"].get(op, {}).get("faithful", {})
            rows.append([str(p["tokens_per_rank"]), op, _fmt(lat[op], ".1f"), ratio, _fmt(eff.get(op), ".2f"),
                         _fmt(acc.get("cosine_min"), ".6f")])
            if spread_column:
                rows[-1].append(_fmt(p.get("spread_pct", {}).get(op), ".2f"))
    return rows


def table(title: str, points: Sequence[Mapping[str, object]], ops: Sequence[str], reference_op: str,
          unavailable: Mapping[str, str]) -> None:
    """The terminal table that ends a run (at most :data:`TABLE_WIDTH` columns wide), then one line per operator
    that did not run, with its reason."""
    spread = _has_spread(points)
    header = [h.format(ref=reference_op) for h in TABLE_HEADER] + [SPREAD_HEADER] * spread
    rows = table_rows(points, ops, reference_op)
    rich = _rich()
    if rich is None:
        print(title)
        print(" | ".join(header))
        for row in rows:
            print(" | ".join(row))
    else:
        t = rich.table.Table(title=title)
        for i, h in enumerate(header):
            t.add_column(h, justify="left" if i == 1 else "right", no_wrap=True)
        for i, row in enumerate(rows):
            t.add_row(*row, end_section=i + 1 < len(rows) and rows[i + 1][0] != row[0])  # a rule between the T
        width = TABLE_WIDTH if not sys.stdout.isatty() else min(TABLE_WIDTH, rich.console.Console().width)
        rich.console.Console(width=width).print(t)
    print(f"over {reference_op}: the latency over {reference_op}'s (> 1: {reference_op} faster); efficiency: the floor "
          "(bytes / copy bandwidth)\nover the latency; cosine: the worst rank's against the quantization-faithful "
          "reference" + ("\nspread %: 100 (max - min) / min of the timing rounds' latencies (each round's: the slowest "
                         "rank's median window)" if spread else ""))
    for op, why in unavailable.items():
        print(f"not run: {op}: {why}")


def write_json(path: Path, data: Mapping[str, object]) -> None:
    """The result file (:func:`gc_moe_compat.ab.protocol.write_result`: paths inside the checkout, relative)."""
    from gc_moe_compat.ab.protocol import write_result

    write_result(path, data)


def plot(points: Sequence[Mapping[str, object]], ops: Sequence[str], reference_op: str, title: str,
         path: Path) -> bool:
    """Latency (with the floor of each weight format) and speedup against tokens per rank, one line per operator;
    returns whether a PNG was written."""
    plt = pyplot() if points else None
    if plt is None:
        return False
    ts = [p["tokens_per_rank"] for p in points]
    color = {op: f"C{i % 10}" for i, op in enumerate(ops)}  # one colour per operator in both panels
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 8), sharex=True)
    for op in ops:
        ys = [p["latency_us"].get(op) for p in points]
        if any(y is not None for y in ys):
            top.plot(ts, [math.nan if y is None else y for y in ys], marker="o", label=op, color=color[op])
    for mma in sorted({m for p in points for m in p.get("floor_us_by_mma", {})}):
        top.plot(ts, [p["floor_us_by_mma"].get(mma, math.nan) for p in points], ":",
                 color="grey" if compute_path(mma).fp4 else "k", label=f"floor {mma} (bytes / copy bandwidth)")
    top.set_xscale("log", base=2)
    top.set_ylabel("latency (µs, slowest rank)")
    top.legend(fontsize=7)  # the floors are always there
    top.set_title(title, fontsize=9)
    for op in ops:
        key = f"{op}_over_{reference_op}"
        ys = [p["speedup"].get(key) for p in points]
        if any(y is not None for y in ys):
            bottom.plot(ts, [math.nan if y is None else y for y in ys], marker="s", label=f"{op} / {reference_op}",
                        color=color[op])
    bottom.axhline(1.0, color="grey", lw=0.5)
    bottom.set_xscale("log", base=2)
    bottom.set_xlabel("tokens per rank")
    bottom.set_ylabel(f"latency ratio over {reference_op} (> 1: {reference_op} faster)")
    if bottom.get_legend_handles_labels()[0]:  # no ratio where the reference operator did not run
        bottom.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _range(values: Sequence[float], spec: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, spec) if format(lo, spec) == format(hi, spec) else f"{format(lo, spec)}–{format(hi, spec)}"


def readme_row(data: Mapping[str, object], name: str) -> str:
    """One results row of a gc-moe-ab result file (``name``: the file's name): the workload and how it was run,
    then each compared operator's latency over the reference operator's (the mean of the per-point ratios, their
    range and count; > 1: the reference is faster) or why it did not run, the reference operator's efficiency
    range, its worst cosine against the quantization-faithful reference and, where the file has timing rounds'
    spreads, the largest of any operator at any point."""
    meta, points = data["meta"], data["points"]
    ref = meta["reference_op"]
    w = meta["workload"]
    ts = [p["tokens_per_rank"] for p in points]
    command = meta["command"] if isinstance(meta["command"], str) else " ".join(meta["command"])
    what = (f"gc-moe-ab {w['name']} (H {w['hidden']}, I {w['intermediate']}, {w['local_experts']} experts per rank, "
            f"top-{w['topk']}), {meta['world_size']}× {meta['gpu']}, T = {_range(ts, 'd').replace('–', '…')} "
            f"(`{name}`; `{command}`{'' if meta.get('complete') else '; incomplete'})")
    ratios, missing = [], []
    summary = meta.get("summary", {})
    for op, info in meta["ops"].items():
        if op == ref:
            continue
        s = summary.get(f"{op}_over_{ref}")
        if s:
            ratios.append(f"`{op}` {s['mean_of_ratios']:.2f} ({_range([s['min'], s['max']], '.2f')}, {s['points']})")
        else:
            missing.append(f"`{op}` {str(info.get('status', 'not run')).split(':')[0]}")
    parts = [f"latency over `{ref}` (mean of the per-point ratios, range, points): {', '.join(ratios)}"] if ratios \
        else []
    parts += missing
    eff = [p["efficiency"][ref] for p in points if ref in p.get("efficiency", {})]
    cos = [p["accuracy"][ref]["faithful"]["cosine_min"] for p in points
           if "faithful" in p.get("accuracy", {}).get(ref, {})]
    if eff:
        parts.append(f"`{ref}` efficiency {_range(eff, '.2f')}")
    if cos:
        parts.append(f"cosine ≥ {min(cos):.5f} vs the faithful reference")
    spreads = [pct for p in points for pct in p.get("spread_pct", {}).values()]
    if spreads:
        parts.append(f"spread between {meta['timing']['repeats']} timing rounds ≤ {max(spreads):.2f} %")
    return f"| {what} | {'; '.join(parts)} |"


def readme_rows(files: Sequence[Path]) -> list[str]:
    """The README rows of ``files`` (one each, in the given order), the markers inline in the first and last."""
    rows = [readme_row(json.loads(Path(f).read_text()), Path(f).name) for f in files]
    if rows:
        rows[0] = rows[0].replace("| ", f"| {README_BEGIN}", 1)
        rows[-1] = rows[-1][: -len(" |")] + f" {README_END} |"
    return rows


def replace_readme_rows(text: str, rows: Sequence[str]) -> str:
    """``text`` with the lines from the one holding :data:`README_BEGIN` to the one holding :data:`README_END`
    replaced by ``rows``; ``ValueError`` where the markers are not there once each, in that order."""
    lines = text.split("\n")
    begin = [i for i, line in enumerate(lines) if README_BEGIN in line]
    end = [i for i, line in enumerate(lines) if README_END in line]
    if len(begin) != 1 or len(end) != 1 or end[0] < begin[0]:
        raise ValueError(f"README: needs one {README_BEGIN} line and one {README_END} line after it, found "
                         f"{len(begin)} and {len(end)}")
    return "\n".join([*lines[: begin[0]], *rows, *lines[end[0] + 1:]])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gc_moe_compat.ab.report",
                                     description="README results rows from gc-moe-ab result files")
    parser.add_argument("--readme-table", nargs="+", type=Path, required=True, metavar="RESULT_JSON")
    parser.add_argument("--write", type=Path, default=None, metavar="README",
                        help="replace the rows between the ab-table markers of this file")
    args = parser.parse_args(argv)
    rows = readme_rows(sorted(args.readme_table, key=lambda p: p.name))
    if args.write is None:
        print("\n".join(rows))
        return 0
    args.write.write_text(replace_readme_rows(args.write.read_text(), rows))
    print(f"{args.write}: {len(rows)} row(s) between the ab-table markers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
