"""Every published number comes from one source: the generated blocks of the README and the docs are
rendered from ``registry/`` and ``registry/results`` JSON by the generators in ``tools/docs/``, and a
stale block fails here."""

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATORS = sorted(path.stem for path in (ROOT / "tools" / "docs").glob("gen_*.py"))
MARKER = re.compile(r"^<!-- BEGIN GENERATED: (?P<name>[^>]+?) -->$", re.M)
#: blocks a package function renders, each held equal by its own test
RENDERED_IN_THE_PACKAGE = {("docs/configuration.md", "fields"): "poros.config.fields_markdown (tests/test_config.py)"}


def generated_blocks() -> set[tuple[str, str]]:
    """``(page, block name)`` of every generated block in the README and docs/."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {(page.relative_to(ROOT).as_posix(), match.group("name")) for page in pages
            for match in MARKER.finditer(page.read_text(encoding="utf-8"))}


def rendered_blocks(name: str) -> set[tuple[str, str]]:
    """``(page, block name)`` of every block the generator ``tools.docs.<name>`` renders."""
    module = importlib.import_module(f"tools.docs.{name}")
    page = getattr(module, "PAGE", None) or module.DOC_PATH
    blocks = module.BLOCKS if hasattr(module, "BLOCKS") else module.render_blocks() if hasattr(module, "render_blocks") else {}
    return {(page.relative_to(ROOT).as_posix(), block) for block in blocks}


@pytest.mark.parametrize("generator", GENERATORS)
def test_every_generated_page_is_current(generator, child_env):
    """The generator, run with ``--check``, would write the page as it is committed."""
    result = subprocess.run([sys.executable, "-m", f"tools.docs.{generator}", "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=600, env=child_env(OMP_NUM_THREADS="1"))
    assert result.returncode == 0, f"python -m tools.docs.{generator}: {result.stdout}{result.stderr[-2000:]}"


def test_every_generated_block_has_its_generator():
    """No block on a page is left without a generator (a hand-edited block would never be checked)."""
    rendered = set(RENDERED_IN_THE_PACKAGE)
    for generator in GENERATORS:
        rendered |= rendered_blocks(generator)
    orphans = sorted(generated_blocks() - rendered)
    assert not orphans, f"generated blocks no generator renders: {orphans}"


def test_the_speed_plot_is_current():
    """docs/img/speed-h200.png is what ``gen_results_docs`` draws from today's records, byte for byte; only under the
    matplotlib and Pillow pyproject's ``docs`` extra pins (other versions draw other bytes)."""
    from tools.docs import gen_results_docs, results_speed, speed_plot

    reason = speed_plot.pin_mismatch()
    if reason:
        pytest.skip(f"speed plot not compared: {reason}")
    fresh = speed_plot.render_png(results_speed.sweep_points(gen_results_docs.bench_reports()))
    assert speed_plot.PLOT.read_bytes() == fresh, "docs/img/speed-h200.png is stale: run python -m tools.docs.gen_results_docs"


def test_a_stale_generated_file_fails_the_check(capsys):
    """``--check`` compares each generated file's bytes (the plot), not only the page's text; one it cannot render
    here is reported, not compared, and not written."""
    from tools.docs import docgen, gen_results_docs, speed_plot

    current = gen_results_docs.PAGE.read_text(encoding="utf-8")
    committed = speed_plot.PLOT.read_bytes()
    same = {speed_plot.PLOT: lambda: committed}
    assert docgen.main("t", gen_results_docs.PAGE, lambda text: text, ["--check"], same) == 0
    assert docgen.main("t", gen_results_docs.PAGE, lambda text: text, ["--check"], {speed_plot.PLOT: lambda: committed + b"x"}) == 1
    assert "docs/img/speed-h200.png is stale" in capsys.readouterr().err

    def unrenderable():
        raise docgen.NotRenderable("matplotlib 0 (pinned 1)")

    assert docgen.main("t", gen_results_docs.PAGE, lambda text: text, ["--check"], {speed_plot.PLOT: unrenderable}) == 0
    assert "not checked: matplotlib 0 (pinned 1)" in capsys.readouterr().err
    assert speed_plot.PLOT.read_bytes() == committed and gen_results_docs.PAGE.read_text(encoding="utf-8") == current


def test_the_plot_pins_are_exact_and_the_tests_install_them():
    """The ``docs`` extra pins matplotlib and Pillow exactly (the plot's bytes depend on both), and the ``test`` extra,
    which the README's set-up command and CI install, takes it."""
    import tomllib

    from tools.docs import speed_plot

    assert set(speed_plot.pins()) == {"matplotlib", "pillow"}
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    assert "poros-train[docs]" in extras["test"]


def _bench(seq, accum, arms=("trl-resident", "trl-poros", "unsloth"), *, date="2026-12-03", model="qwen2.5-32b",
           deterministic=False, layers=64, dense=780.0, **config):
    info = {"num_hidden_layers": layers, "full_depth": 64}
    return {"environment": {"date": date}, "dense_bf16_tflops": dense,
            "config": {"model": model, "model_info": info, "seq": seq, "grad_accum": accum, "deterministic": deterministic,
                       **config},
            "arms": {name: {"status": "ok", "tokens_per_s": 1000.0 + seq, "mfu": 0.3} for name in arms}}


def test_the_speed_plot_draws_the_newest_sweep_run_per_seq_and_accumulation():
    """One record per (seq, accumulation): the newest by date, then session (``-s10`` after ``-s9`` after the day's
    first directory); deterministic runs, other shapes, truncated depth, memory caps, Liger variants, runs without
    the machine's numbers or without a plotted arm are left out. An arm with several accumulations at one seq gets a
    line per accumulation; otherwise one line through its seqs."""
    from tools.docs import results_speed, speed_plot

    root = Path("registry/results")
    reports = [
        (root / "h200-2026-12-02" / "bench-a.json", _bench(512, 8, date="2026-12-02")),
        (root / "h200-2026-12-03-s10" / "bench-a.json", _bench(512, 8)),
        (root / "h200-2026-12-03-s9" / "bench-a.json", _bench(512, 8)),
        (root / "h200-2026-12-03" / "bench-a.json", _bench(512, 8)),
        (root / "h200-2026-12-03" / "bench-b.json", _bench(2048, 4)),
        (root / "h200-2026-12-04" / "bench-det.json", _bench(2048, 4, date="2026-12-04", deterministic=True)),
        (root / "h200-2026-12-04" / "bench-72b.json", _bench(2048, 4, date="2026-12-04", model="qwen2.5-72b")),
        (root / "h200-2026-12-04" / "bench-depth.json", _bench(2048, 4, date="2026-12-04", layers=8)),
        (root / "h200-2026-12-04" / "bench-cap.json", _bench(2048, 4, date="2026-12-04", vram_limit_gb=24)),
        (root / "h200-2026-12-04" / "bench-liger.json", _bench(2048, 4, date="2026-12-04", use_liger_kernel=True)),
        (root / "h200-2026-12-04" / "bench-old.json", _bench(2048, 4, date="2026-12-04", dense=None)),
        (root / "h200-2026-12-04" / "bench-peft.json", _bench(2048, 4, ("resident", "poros"), date="2026-12-04")),
    ]
    chosen = results_speed.sweep_points(reports)
    assert [path.parent.name + "/" + path.name for path, _ in chosen] == ["h200-2026-12-03-s10/bench-a.json",
                                                                         "h200-2026-12-03/bench-b.json"]
    lines = speed_plot.series(speed_plot.points(chosen))
    assert [(arm, [(seq, accum) for seq, accum, *_ in line]) for arm, line in lines] == [
        (arm, [(512, 8), (2048, 4)]) for arm in ("trl-resident", "trl-poros", "unsloth")]
    sweep = [(root / "h200-2026-12-05" / f"sweep-{seq}-{accum}.json", _bench(seq, accum, ("trl-poros",), date="2026-12-05"))
             for seq in (512, 2048) for accum in (1, 8)]
    lines = speed_plot.series(speed_plot.points(results_speed.sweep_points(sweep)))
    assert [(arm, [(seq, accum) for seq, accum, *_ in line]) for arm, line in lines] == [
        ("trl-poros", [(512, 1), (2048, 1)]), ("trl-poros", [(512, 8), (2048, 8)])]


def test_a_sweeps_per_configuration_reports_are_bench_reports(tmp_path):
    """``--sweep`` writes one bench report per configuration (``sweep-<seq>-<accum>.json``) beside its merged JSON: the
    tables and the plot read those; the merged rows (no ``config``) are not read twice."""
    import json

    from tools.docs import gen_results_docs, results_speed

    report = _bench(8192, 1)
    (tmp_path / "sweep-8192-1.json").write_text(json.dumps(report))
    (tmp_path / "sweep-all.json").write_text(json.dumps({"tool": "tools.bench --sweep", "rows": [{"seq": 8192}]}))
    found = gen_results_docs.bench_reports([tmp_path])
    assert found == [(tmp_path / "sweep-8192-1.json", report)]
    assert results_speed.sweep_points(found) == found


def test_every_gate_record_in_the_registry_has_its_evidence():
    from poros import records

    for family in records.all_families():
        for record in records.validations(family):
            assert record["label"] in records.LABELS
            evidence = record.get("evidence")
            if evidence:
                assert (ROOT / evidence).exists(), f"{family}: {evidence} is not committed"


# -- no measured number typed outside a generated block ----------------------------------------------------
#
# A measured number is a figure with a unit of what a run produced -- GB, MB, TB, GB/s, s, ms, tokens/s, tok/s,
# TFLOP/s, %, or a ratio such as ``0.84x`` -- in a sentence (or a table row, with its header) that says it was
# measured. The rule is precise rather than broad:
#   * the dated log (results-h200-log.md) is exempt: it is the narrative of each session, kept as written on
#     the day (issue 40's split of the results page into generated tables and a dated log);
#   * fenced code blocks and inline code are left out (commands, config values, sample output);
#   * GiB and MiB are not measured units here: budgets, caps, cards and buffers are given in them;
#   * a decimal figure counts beside any run word (STEP_WORDS), a whole one only beside a measuring word
#     (MEASURED_WORDS): inputs and defaults are whole numbers ("30 s", "512 MiB"), measurements rarely are;
#   * INPUTS lists the few input phrasings that would otherwise look measured: a memory cap ("an 8 GB cap",
#     "8 GB / 12 GB memory caps", "a cap of 6 GB"), a target or threshold ("the 1.05x target", "target 1.25x",
#     "at most 0.6x") and the planner's allocator slack ("20 % slack").
# A figure a page needs is rendered into a generated block from registry/results (tools/docs/gen_*.py); a
# sentence that needs only the idea points at that table. Sizes the planner computes from a shape may be
# written where no measuring word stands beside them.
EXEMPT_PAGES = {"docs/results-h200-log.md"}
_FIGURE = r"[+\-−±~≈]?\d[\d,]*(?:\.\d+)?"
_UNIT = r"(?: ?(?:GB/s|GB|MB|TB|tokens/s|tok/s|TFLOP/s|ms|s|%)(?![\w/])|[x×](?!\w))"
MEASURED_FIGURE = re.compile(rf"(?<![\w.]){_FIGURE}(?:[–-]{_FIGURE})?{_UNIT}")
MEASURED_WORDS = re.compile(r"\b(measur\w*|peak\w*|took|ran|median|traced|timed|H200|RTX|"
                            r"on (?:this|that) (?:machine|host|drive))\b", re.I)
STEP_WORDS = re.compile(r"\b(steps?|starts?|reads?|runs?|copied|spent|reached|stall\w*|reserved|allocated|resident)\b",
                        re.I)
INPUTS = re.compile(rf"{_FIGURE} ?GB(?: / {_FIGURE} ?GB)? (?:memory )?caps?\b|\bcaps? of {_FIGURE} ?GB"
                    rf"|\btargets? (?:of |is |<= |≤ |≥ )?{_FIGURE}{_UNIT}|{_FIGURE}{_UNIT} target"
                    rf"|(?:at most|at least|<=|≤|>=|≥) ?{_FIGURE}{_UNIT}|{_FIGURE} ?% (?:for )?(?:the )?(?:allocator's |allocator )?slack",
                    re.I)
#: a table whose header names a measured column: any decimal in its rows counts
MEASURED_HEADER = re.compile(r"\b(GB|MB|s|ms|tokens/s|tok/s|TFLOP/s|GB/s)\b|%|\bx\b|\bpeak|\bstep|\bmeasured", re.I)
TABLE_DECIMAL = re.compile(r"(?<![\w./])\d+\.\d+(?![\w.])")
_BLOCK = re.compile(r"<!-- BEGIN GENERATED: (?P<name>[^>]+?) -->\n.*?<!-- END GENERATED: (?P=name) -->", re.S)
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK_TARGET = re.compile(r"\]\([^)\s]*\)")
_SENTENCE_END = re.compile(r"(?<=[.;!?])\s+(?=[A-Z(*`])")


def prose_units(text: str):
    """``(line, text, is a table row)`` of a page's prose outside generated blocks and code fences: each
    paragraph or list item joined into one text, each table row with its header."""
    text = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), _BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), text))
    lines, current, start, header = text.split("\n"), [], 0, ""
    for number, line in enumerate(lines, 1):
        if (line.lstrip().startswith(("- ", "* ")) or line.startswith(("|", "#")) or not line.strip()) and current:
            yield start, " ".join(current), False
            current = []
        if line.startswith("|"):
            if number < 2 or not lines[number - 2].startswith("|"):
                header = line
            elif not set(line) <= set("|-: "):
                yield number, f"{header}\n{line}", True
            continue
        if line.startswith("#") or not line.strip():
            continue
        start = start if current else number
        current.append(line.strip())
    if current:
        yield start, " ".join(current), False


def measured_figures(text: str) -> list[tuple[int, str]]:
    """``(line, figure)`` of every measured-looking figure a page types outside its generated blocks."""
    found = []
    for line, unit, table in prose_units(text):
        unit = _LINK_TARGET.sub("]", _CODE.sub("``", unit))
        if table:
            header, row = unit.split("\n")
            if MEASURED_HEADER.search(header):
                found += [(line, m.group(0)) for m in TABLE_DECIMAL.finditer(row)]
            unit = row
        for sentence in _SENTENCE_END.split(unit):
            sentence = INPUTS.sub(" ", sentence)
            measured, run = MEASURED_WORDS.search(sentence), STEP_WORDS.search(sentence)
            found += [(line, m.group(0)) for m in MEASURED_FIGURE.finditer(sentence)
                      if measured or (run and "." in m.group(0))]
    return sorted(set(found))


def test_the_rule_sees_a_typed_measurement_and_passes_inputs():
    """The pattern itself: typed measurements are found, the listed input phrasings and code are not."""
    assert measured_figures("The 72B run peaked at 5.75 GB under an 8 GB cap.\n") == [(1, "5.75 GB")]
    assert measured_figures("It took 12 s on that machine, 1.05x the resident step.\n") == [(1, "1.05x"), (1, "12 s")]
    assert measured_figures("| shape | peak GB |\n|---|---|\n| qwen2.5-32b | 5.20 |\n") == [(3, "5.20")]
    assert measured_figures("Under a 6 GB cap, against the 1.05x target, at most 0.6x the step; 20 % slack.\n") == []
    assert measured_figures("A line every 30 s, the step of `--vram-budget 7.5GiB` (default 512 MiB).\n\n```\n1.52 s/step peak\n```\n") == []
    assert measured_figures("<!-- BEGIN GENERATED: t -->\npeak 5.75 GB\n<!-- END GENERATED: t -->\n") == []


def test_no_page_types_a_measured_number_outside_a_generated_block():
    """README.md and every docs/*.md page but the dated log: a measured figure stands only inside a generated
    block (rendered from registry/results by tools/docs/gen_*.py); every offender is listed."""
    offenders = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        name = page.relative_to(ROOT).as_posix()
        if name not in EXEMPT_PAGES:
            offenders += [f"{name}:{line}: {figure}" for line, figure in measured_figures(page.read_text(encoding="utf-8"))]
    assert not offenders, ("measured figures typed outside a generated block (render them from registry/results "
                           "in a tools/docs/gen_*.py block, or say the idea and point at the table):\n"
                           + "\n".join(offenders))


def test_runs_on_another_card_are_tabled_apart_from_the_h200s():
    """A bench report under ``registry/results/h100-*`` (the GPU tool lends an H100 at times) is a row of the
    other-cards table, named with its card, and never a row of the H200 tables."""
    from tools.docs import gen_results_docs as gen

    others = [path for path, _ in gen.bench_reports(gen.OTHER_CARDS)]
    assert others and all(not p.parent.name.startswith(("h200-", "cpu-")) for p in others)
    table = gen.render_other_cards()
    h200 = gen.render_bench(capped=False) + gen.render_bench(capped=True) + gen.render_trainer()
    for path, report in gen.bench_reports(gen.OTHER_CARDS):
        where = path.relative_to(ROOT).as_posix()
        assert where in table and where not in h200
        assert f"| {report['environment']['platform']} | {report['config']['model']} |" in table
