"""The speed plot: tokens/s and MFU against sequence length, one line per arm, drawn from the H200 bench JSON
(``results_speed.sweep_points``: per (seq, accumulation) the newest run) by ``python -m tools.docs.gen_results_docs``,
which writes ``docs/img/speed-h200.png`` with the tables; README.md and docs/results-h200.md show it in a generated
block that links the JSON it came from.

The PNG's bytes are the same on every machine with the same matplotlib and Pillow (Pillow writes matplotlib's PNGs):
both are pinned in pyproject.toml's ``docs`` extra (the ``test`` extra takes it), the figure is drawn on matplotlib's
own defaults (no ``matplotlibrc`` is read) with its bundled DejaVu Sans at a fixed size and dpi, and no ``Software``
metadata is written. With other versions the plot is neither written nor checked (:func:`pin_mismatch`).
"""

from __future__ import annotations

import io
import os
import re
import tomllib
from importlib import metadata
from pathlib import Path

from tools.docs import docgen, results_speed

PLOT = docgen.ROOT / "docs" / "img" / "speed-h200.png"
#: each plotted arm's label, colour, line style and whether its markers are filled: Unsloth is drawn last, dashed with
#: hollow markers, so where its line meets another both stay visible
ARM_STYLE = {"trl-resident": ("TRL resident", "#4c72b0", "-", True),
             "trl-poros": ("TRL + prepare_trainer", "#c44e52", "-", True),
             "unsloth": ("Unsloth", "#dd8452", "--", False)}
#: one marker per gradient accumulation (others take the last)
MARKERS = {1: "o", 2: "s", 4: "^", 8: "D", None: "P"}
SEQ_TICKS = (512, 1024, 2048, 4096, 8192)
FIGURE = {"figsize": (10.0, 4.0), "dpi": 100}
STYLE = {"font.family": "DejaVu Sans", "font.size": 9, "axes.grid": True, "grid.alpha": 0.3}
ALT = ("Qwen2.5-32B shape on one H200, deterministic algorithms off: tokens/s (left) and MFU (right) against "
       "sequence length for TRL resident, TRL + prepare_trainer and Unsloth")


def pins() -> dict[str, str]:
    """The exact versions pyproject.toml's ``docs`` extra pins (``name==version``), by package name."""
    project = tomllib.loads((docgen.ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    found = (re.fullmatch(r"([A-Za-z0-9_.-]+)==([^;\s]+)", item.strip())
             for item in project["optional-dependencies"]["docs"])
    return {match.group(1): match.group(2) for match in found if match}


def pin_mismatch() -> str | None:
    """Why this machine cannot draw the plot byte for byte (a pinned package missing or at another version);
    None when it can."""
    wrong = []
    for name, version in pins().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = "not installed"
        if installed != version:
            wrong.append(f"{name} {installed} (pinned {version})")
    if not wrong:
        return None
    return f"{', '.join(wrong)}: the plot's bytes depend on them; pip install -e '.[docs]'"


def points(records: list[tuple[Path, dict]]) -> list[tuple[str, int, int, float, float]]:
    """``(arm, seq, accumulation, tokens/s, MFU %)`` of each plotted arm that ran at full depth with a throughput."""
    found = []
    for _, report in records:
        config = report["config"]
        full = config["model_info"]["full_depth"]
        for name in (n for n in results_speed.PLOT_ARMS if n in report["arms"]):
            arm = report["arms"][name]
            if arm.get("status") == "ok" and arm.get("tokens_per_s") and arm.get("mfu") is not None \
                    and (arm.get("layers") or full) == full:
                found.append((name, config["seq"], config.get("grad_accum", 1), arm["tokens_per_s"], 100 * arm["mfu"]))
    return found


def series(found: list[tuple[str, int, int, float, float]]) -> list[tuple[str, list[tuple[int, int, float, float]]]]:
    """The lines: per arm, its points by seq; an arm with several accumulations at one seq (a sweep) gets one line
    per accumulation, otherwise one line through its seqs (each point's marker gives its accumulation)."""
    lines = []
    for name in results_speed.PLOT_ARMS:
        mine = sorted((seq, accum, tokens, mfu) for arm, seq, accum, tokens, mfu in found if arm == name)
        seqs = [seq for seq, *_ in mine]
        if len(seqs) != len(set(seqs)):
            lines += [(name, [p for p in mine if p[1] == accum]) for accum in sorted({p[1] for p in mine})]
        elif mine:
            lines.append((name, mine))
    return lines


def render_png(records: list[tuple[Path, dict]]) -> bytes:
    """The plot's PNG bytes; :class:`docgen.NotRenderable` where the pinned matplotlib / Pillow are not installed."""
    reason = pin_mismatch()
    if reason:
        raise docgen.NotRenderable(reason)
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    found = points(records)
    with matplotlib.rc_context():
        matplotlib.rcdefaults()  # no matplotlibrc of this machine
        matplotlib.rcParams.update(STYLE)
        figure = Figure(**FIGURE)
        FigureCanvasAgg(figure)
        tokens_axes, mfu_axes = figure.subplots(1, 2)
        for name, line in series(found):
            _, colour, style, filled = ARM_STYLE[name]
            marker_style = {"markersize": 6} if filled else {"markersize": 9, "fillstyle": "none", "markeredgewidth": 1.5}
            seqs = [seq for seq, *_ in line]
            tokens_axes.plot(seqs, [p[2] for p in line], color=colour, linestyle=style, linewidth=1.5)
            mfu_axes.plot(seqs, [p[3] for p in line], color=colour, linestyle=style, linewidth=1.5)
            for seq, accum, tokens, mfu in line:
                marker = MARKERS.get(accum, MARKERS[None])
                tokens_axes.plot([seq], [tokens], marker=marker, color=colour, linestyle="none", **marker_style)
                mfu_axes.plot([seq], [mfu], marker=marker, color=colour, linestyle="none", **marker_style)
        for axes, title in ((tokens_axes, "tokens/s"), (mfu_axes, "MFU (% of the measured dense bf16 rate)")):
            axes.set_xscale("log", base=2)
            axes.set_xlim(SEQ_TICKS[0] / 1.25, SEQ_TICKS[-1] * 1.25)
            axes.set_xticks(SEQ_TICKS, [str(seq) for seq in SEQ_TICKS])
            axes.minorticks_off()
            axes.set_ylim(bottom=0)
            axes.set_xlabel("sequence length (tokens)")
            axes.set_title(title)
        if not found:
            tokens_axes.text(0.5, 0.5, "pending the H200 run", transform=tokens_axes.transAxes, ha="center")
        arms = [Line2D([], [], color=ARM_STYLE[name][1], linestyle=ARM_STYLE[name][2], linewidth=1.5,
                       label=ARM_STYLE[name][0]) for name in results_speed.PLOT_ARMS if any(p[0] == name for p in found)]
        accumulations = [Line2D([], [], color="#555555", marker=MARKERS.get(accum, MARKERS[None]), linestyle="none",
                                label=f"accumulation {accum}") for accum in sorted({p[2] for p in found})]
        for handles, y in ((arms, 0.07), (accumulations, 0.0)):
            if handles:
                figure.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, y), ncol=len(handles),
                              frameon=False)
        figure.suptitle("Qwen2.5-32B shape, H200, batch 1, deterministic off")
        figure.subplots_adjust(left=0.07, right=0.98, top=0.86, bottom=0.3, wspace=0.22)
        out = io.BytesIO()
        figure.savefig(out, format="png", dpi=FIGURE["dpi"], metadata={"Software": None})
    return out.getvalue()


def render_block(records: list[tuple[Path, dict]], page: Path) -> str:
    """The generated block that shows the plot on ``page`` (README.md or a docs/ page): the image with its alt text
    and a link to every JSON it was drawn from."""
    def link(path: Path) -> str:
        return Path(os.path.relpath(path, page.parent)).as_posix()

    sources = ", ".join(f"[seq {report['config']['seq']}, accumulation {report['config'].get('grad_accum', 1)}]"
                        f"({link(path)})" for path, report in records)
    image = link(PLOT)
    return (f"![{ALT}]({image})\n\nDrawn by `python -m tools.docs.gen_results_docs` from the newest run at each "
            f"sequence length and accumulation: {sources or 'pending the H200 run'}.")


__all__ = ["ALT", "PLOT", "pin_mismatch", "pins", "points", "render_block", "render_png", "series"]
