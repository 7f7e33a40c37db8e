"""The paper's figure and table scripts (artifacts/Figure*/, artifacts/Table*/ and their
machinery, artifacts/paper.py) without a GPU.

Most tests replace the measuring functions by fakes, so they exercise what the scripts
themselves do -- cases and systems, the CSV and its resumption, the ncu and plan parsing,
the plots -- in a second and without torch; the plots skip where matplotlib cannot be
imported.  The smoke tests at the end run the real scripts on the CPU (the peers timed
there, welder only planned from the H100's cost model) and skip without torch.
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "artifacts"))

import paper  # noqa: E402
import run_torch  # noqa: E402

benchmark = paper.benchmark
SCRIPTS = ("Figure9_10", "Figure10b", "Figure11", "Figure13", "Table4", "Table5")
TINY = json.dumps({"nerf": {"points": 64}})


def script(folder: str) -> ModuleType:
    """artifacts/<folder>/run_all.py as a module (the folders are not packages)."""
    return paper.script_module(folder)


def need(*packages: str) -> None:
    for package in packages:
        try:
            importlib.import_module(package)
        except Exception as e:
            pytest.skip(f"{package} cannot be imported here ({type(e).__name__})")


def fake_cells(calls: list[tuple[str, tuple[str, ...]]]) -> Any:
    """A measure_case that records its calls: welder 1 ms, eager 4 ms, compile 2 ms,
    max-autotune fails, onnxruntime absent; everything else 3 ms."""

    def measure_case(
        case: benchmark.Config, systems: list[str], args: Any
    ) -> Iterator[tuple[str, benchmark.Cell]]:
        calls.append((case.key, tuple(systems)))
        ms = {"welder": 1.0, "welder-no-tc": 1.5, "eager": 4.0 * case.batch, "compile": 2.0}
        for s in systems:
            if s == "compile-max-autotune":
                yield s, benchmark.Cell(error="RuntimeError: no triton")
            elif s == "onnxruntime":
                yield s, benchmark.Cell(absent="CUDAExecutionProvider absent")
            else:
                yield s, benchmark.Cell(ms=ms.get(s, 3.0), build_s=1.0)

    return measure_case


# -- without torch ---------------------------------------------------------------------------


@pytest.mark.parametrize("folder", SCRIPTS)
def test_every_script_has_help_naming_its_outputs(folder: str) -> None:
    proc = subprocess.run(
        [sys.executable, f"artifacts/{folder}/run_all.py", "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    for option in ("--models", "--bs", "--dtype", "--systems", "--device", "--redo", "--plot-only"):
        assert option in proc.stdout
    assert f"{folder.lower()}" in proc.stdout.lower() and ".csv" in proc.stdout


def test_cases_leave_nerf_at_batch_one_and_unknown_names_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = paper.build_parser("t", systems=("welder", "eager"))
    args = paper.parse_args(
        parser, ["--models", "nerf,bert", "--bs", "1,64", "--dtype", "fp16", "--device", "cpu"]
    )
    assert [c.key for c in paper.cases(args)] == ["nerf_b1_fp16", "bert_b1_fp16", "bert_b64_fp16"]
    assert "nerf:64 left out" in capsys.readouterr().err
    assert args.out == ROOT / "artifacts" / "results" / "cpu" and args.welder.cache_dir is None
    for bad in (["--models", "gpt7"], ["--dtype", "int8"], ["--systems", "tvm"]):
        with pytest.raises(SystemExit):
            paper.parse_args(parser, [*bad, "--device", "cpu"])


def test_pending_lists_what_a_run_would_measure_and_measures_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--pending names each case and system the CSV lacks (failed lines too with
    --retry-errors), writes nothing, and a run with the same options then measures exactly
    those."""
    calls: list[tuple[str, tuple[str, ...]]] = []
    monkeypatch.setattr(paper, "measure_case", fake_cells(calls))
    fig = script("Figure9_10")
    argv = ["--device", "cpu", "--out", str(tmp_path), "--runs", str(tmp_path / "runs")]
    assert fig.main([*argv, "--models", "bert", "--bs", "1", "--dtype", "fp32"]) == 0
    csv_before = (tmp_path / "figure9_10.csv").read_text()
    calls.clear()
    wider = [*argv, "--models", "bert,nerf", "--bs", "1,64"]

    def pending(*extra: str) -> list[str]:
        capsys.readouterr()
        assert fig.main([*wider, "--pending", *extra]) == 0
        return capsys.readouterr().out.splitlines()

    listed = pending("--systems", "welder,compile-max-autotune")
    assert listed[:-1] == [
        "bert_b1_fp16: welder, compile-max-autotune",
        "bert_b64_fp32: welder, compile-max-autotune",
        "bert_b64_fp16: welder, compile-max-autotune",
        "nerf_b1_fp32: welder, compile-max-autotune",
        "nerf_b1_fp16: welder, compile-max-autotune",
    ]
    assert listed[-1].startswith("5 case(s) to measure, 10 line(s)")
    assert pending("--retry-errors")[0] == "bert_b1_fp32: compile-max-autotune"
    assert calls == [] and (tmp_path / "figure9_10.csv").read_text() == csv_before
    listed = pending()
    assert fig.main(wider) == 0
    assert [f"{key}: {', '.join(systems)}" for key, systems in calls] == listed[:-1]


def test_pending_marks_the_lines_figure9_10_would_give(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another script's --pending says which of its lines figure9_10.csv already has (an
    ok line, or a peer's timeout at this run's limit or more): those cost no timing."""
    case = benchmark.Config("bert", 1, "fp16")
    shared = paper.ResultsCsv(tmp_path / "figure9_10.csv", paper.LATENCY_FIELDS)
    shared.put(paper.cell_row(case, "eager", benchmark.Cell(ms=7.25), "H100"))
    shared.put(paper.cell_row(case, "compile", benchmark.Cell(error="boom"), "H100"))
    late = benchmark.Cell(error=f"compile-max-autotune timed out after 240 s {paper.PEER_TIMEOUT}")
    shared.put(paper.cell_row(case, "compile-max-autotune", late, "H100"))
    argv = ["--models", "bert", "--bs", "1", "--dtype", "fp16", "--device", "cpu", "--out", str(tmp_path)]
    argv += ["--systems", "welder-no-tc,eager,compile,compile-max-autotune", "--pending"]
    for limit, marked in (
        ("240", "compile-max-autotune (from figure9_10.csv)"),
        ("600", "compile-max-autotune"),
    ):
        assert script("Figure10b").main([*argv, "--peer-timeout-s", limit]) == 0
        listed = capsys.readouterr().out.splitlines()
        assert listed[0] == f"bert_b1_fp16: welder-no-tc, eager (from figure9_10.csv), compile, {marked}"
        taken = 2 if limit == "240" else 1
        assert listed[1].startswith(f"1 case(s) to measure, 4 line(s) ({taken} from figure9_10.csv)")


def test_results_csv_round_trip_and_retry(tmp_path: Path) -> None:
    store = paper.ResultsCsv(tmp_path / "r.csv", paper.LATENCY_FIELDS)
    case = benchmark.Config("bert", 1, "fp16")
    store.put(paper.cell_row(case, "welder", benchmark.Cell(ms=0.123456789, build_s=2.0), "H100"))
    store.put(paper.cell_row(case, "eager", benchmark.Cell(error="boom"), "H100"))
    again = paper.ResultsCsv(tmp_path / "r.csv", paper.LATENCY_FIELDS)
    assert again.get(case, "welder")["latency_ms"] == "0.123457"
    assert again.get(case, "eager")["status"] == "error" and again.get(case, "eager")["detail"] == "boom"
    assert again.done(case, "welder") and again.done(case, "eager") and not again.done(case, "compile")
    assert not again.done(case, "eager", retry_errors=True)
    assert paper.number(again.get(case, "welder"), "build_s") == 2.0 and paper.number(None, "x") is None


def test_figure9_10_writes_csv_resumes_and_retries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case and system measured once into the CSV; a second run measures nothing;
    --retry-errors measures only the failed system, --redo everything selected again."""
    calls: list[tuple[str, tuple[str, ...]]] = []
    monkeypatch.setattr(paper, "measure_case", fake_cells(calls))
    fig = script("Figure9_10")
    argv = ["--models", "bert,nerf", "--bs", "1,64", "--dtype", "fp32,fp16", "--device", "cpu"]
    argv += ["--out", str(tmp_path), "--runs", str(tmp_path / "runs")]
    before = signal.getsignal(signal.SIGTERM)
    assert fig.main(argv) == 0
    # Its SIGTERM handler is the run's alone: pools forked later must still die of SIGTERM.
    assert signal.getsignal(signal.SIGTERM) is before
    assert len(calls) == 6 and all(len(systems) == 5 for _, systems in calls)
    lines = (tmp_path / "figure9_10.csv").read_text().splitlines()
    assert lines[0].startswith("model,bs,dtype,system,status,latency_ms") and len(lines) == 1 + 30
    assert "bert,64,fp16,onnxruntime,absent,,,CUDAExecutionProvider absent,cpu," in "\n".join(lines)
    assert json.loads((tmp_path / "figure9_10.meta.json").read_text())["runs"][0]["command"]
    assert "| bert | 1 | fp32 | 1 | 4 | 2 | error | absent |" in (tmp_path / "figure9_10.md").read_text()

    assert fig.main(argv) == 0 and len(calls) == 6
    assert fig.main([*argv, "--retry-errors"]) == 0
    assert calls[6:] == [(k, ("compile-max-autotune",)) for k, _ in calls[:6]]
    assert fig.main([*argv, "--redo", "--models", "nerf", "--systems", "eager"]) == 0
    assert calls[12:] == [("nerf_b1_fp32", ("eager",)), ("nerf_b1_fp16", ("eager",))]
    assert len((tmp_path / "figure9_10.csv").read_text().splitlines()) == 31
    head = (
        (tmp_path / "figure9_10.md").read_text().splitlines()[0]
    )  # every system, though the run asked for one
    assert head.count("latency_ms") == 5 and "compile-max-autotune latency_ms" in head
    assert len(json.loads((tmp_path / "figure9_10.meta.json").read_text())["runs"]) == 4


def test_figure9_10_draws_speedups_with_a_geomean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    need("matplotlib")
    monkeypatch.setattr(paper, "measure_case", fake_cells([]))
    argv = ["--models", "bert,vit_small_p32", "--device", "cpu", "--out", str(tmp_path)]
    assert script("Figure9_10").main(argv) == 0
    for png in ("figure9_fp32.png", "figure10a_fp16.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    rows = paper.ResultsCsv(tmp_path / "figure9_10.csv", paper.LATENCY_FIELDS).rows()
    value = paper._speedups(paper.latency_of(rows), ["bert", "vit_small_p32"], 64, "fp32")
    assert value("bert", "welder") == 256.0 and value("bert", "onnxruntime") is None
    assert (
        value("geomean", "compile") == pytest.approx(128.0)
        and value("geomean", "compile-max-autotune") is None
    )


def test_a_geomean_is_over_every_model_or_none() -> None:
    """A system measured on some of the panel's models has no geometric mean: beside the
    others' it would be over other cases (Table 5's max-autotune on BERT alone read 1.04x)."""
    latency = {
        ("resnet50", "64", "fp32", "eager"): 20.0,
        ("bert", "64", "fp32", "eager"): 36.0,
        ("resnet50", "64", "fp32", "welder"): 10.0,
        ("bert", "64", "fp32", "welder"): 4.5,
        ("bert", "64", "fp32", "compile-max-autotune"): 12.0,
    }
    value = paper._speedups(latency, ["resnet50", "bert"], 64, "fp32")
    assert value("geomean", "welder") == pytest.approx(4.0)  # of 2x and 8x
    assert value("bert", "compile-max-autotune") == 3.0 and value("geomean", "compile-max-autotune") is None


def test_the_legend_fits_a_narrow_figure(tmp_path: Path) -> None:
    """Five long entries above a figure 8 inches wide wrap into rows instead of running
    off both edges (Table 5's legend lost its first and last entries)."""
    need("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    for k in range(5):
        ax.plot([], [], marker="s", linestyle="", label=f"torch.compile reduce-overhead {k}")
    paper.finish(fig, [ax], tmp_path / "legend.png", "note")
    fig.canvas.draw()
    box = fig.legends[0].get_window_extent()
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width
    plt.close(fig)


def test_speedup_bars_stand_on_one_and_every_series_keeps_its_colour() -> None:
    """A speedup's bar starts at 1x (a slowdown hangs below it) and is labelled with its
    value; a series with no value still has its own colour in the legend; log ticks read
    as plain numbers."""
    need("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    fig, ax = plt.subplots()
    values = {("a", "welder"): 2.0, ("b", "welder"): 0.5, ("a", "compile"): 1.5}
    paper.grouped_bars(
        ax,
        ["a", "b"],
        ["welder", "compile", "onnxruntime"],
        lambda g, s: values.get((g, s)),
        ylabel="x",
        log=True,
        base=1.0,
    )
    bars = [(round(r.get_y(), 6), round(r.get_height(), 6)) for r in ax.patches]
    assert sorted(bars) == [(1.0, -0.5), (1.0, 0.5), (1.0, 1.0)]
    assert {t.get_text().strip() for t in ax.texts} >= {"2", "0.5", "1.5", "x"}
    handles, labels = ax.get_legend_handles_labels()
    assert labels == ["welder", "torch.compile reduce-overhead", "onnxruntime"]
    assert [to_rgba(h.get_color()) for h in handles] == [to_rgba(f"C{k}") for k in range(3)]
    assert paper._minor_label(0.2, 0) == "0.2" and paper._minor_label(50.0, 0) == "50"
    assert paper._minor_label(3.0, 0) == ""
    plt.close(fig)


def test_a_model_whose_torch_call_was_not_captured_is_starred(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a torch system's device time had to be taken around calls (host launches
    inside), that model's label carries a star and the footnote says why; other models and
    other batches do not."""
    need("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for model in ("bert", "conformer"):
        for bs in ("1", "64"):
            for system in ("welder", "eager"):
                uncaptured = model == "conformer" and bs == "1" and system == "eager"
                detail = f"eager could not be captured (x): {run_torch.BUSY_TIME}" if uncaptured else ""
                rows.append(
                    dict(model=model, bs=bs, dtype="fp32", system=system, status="ok", gpu="G")
                    | dict(latency_ms="1.0" if system == "welder" else "2.0", detail=detail)
                )
    shown: list = []
    monkeypatch.setattr(plt, "close", shown.append)  # keep the figure to read its labels
    assert paper.speedup_figure(rows, tmp_path / "f.png", "fp32", ["eager", "welder"], "F")
    monkeypatch.undo()
    (fig,) = shown
    ticks = [[t.get_text() for t in ax.get_xticklabels()] for ax in fig.axes]
    assert ticks == [["bert", "conformer*", "geomean"], ["bert", "conformer", "geomean"]]
    assert any("*: a torch system's call could not be captured" in t.get_text() for t in fig.texts)
    plt.close(fig)


def test_without_matplotlib_the_csv_is_written_and_the_png_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(paper, "measure_case", fake_cells([]))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    argv = ["--models", "bert", "--bs", "1", "--device", "cpu", "--out", str(tmp_path)]
    assert script("Figure10b").main(argv) == 0
    assert (tmp_path / "figure10b.csv").is_file() and not list(tmp_path.glob("*.png"))
    assert "figure10b_fp16.png skipped, the CSV is written" in capsys.readouterr().err
    assert "welder-no-tc" in (tmp_path / "figure10b.csv").read_text()


def test_workers_sharing_a_csv_keep_each_others_lines(tmp_path: Path) -> None:
    """Two stores opened on one file before either writes (two --gpus workers): every
    line either puts survives, and processes putting at once lose none under the lock."""
    first = paper.ResultsCsv(tmp_path / "r.csv", paper.LATENCY_FIELDS)
    second = paper.ResultsCsv(tmp_path / "r.csv", paper.LATENCY_FIELDS)
    one, two = benchmark.Config("bert", 1, "fp16"), benchmark.Config("nerf", 1, "fp32")
    first.put(paper.cell_row(one, "welder", benchmark.Cell(ms=1.0), "H100"))
    second.put(paper.cell_row(two, "eager", benchmark.Cell(ms=2.0), "H100"))
    first.put(paper.cell_row(one, "eager", benchmark.Cell(ms=3.0), "H100"))
    again = paper.ResultsCsv(tmp_path / "r.csv", paper.LATENCY_FIELDS)
    assert {(r["model"], r["system"]) for r in again.rows()} == {
        ("bert", "welder"),
        ("nerf", "eager"),
        ("bert", "eager"),
    }

    code = (
        "import sys; sys.path.insert(0, 'artifacts'); import paper\n"
        "store = paper.ResultsCsv(paper.Path(sys.argv[1]), paper.LATENCY_FIELDS)\n"
        "for k in range(40):\n"
        "    case = paper.Config('m' + sys.argv[2], k, 'fp32')\n"
        "    store.put(paper.cell_row(case, 'eager', paper.Cell(ms=1.0), 'x'))\n"
    )
    csv_path = tmp_path / "many.csv"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(csv_path), str(i)], cwd=ROOT) for i in range(3)
    ]
    assert all(proc.wait(120) == 0 for proc in procs)
    assert len(paper.ResultsCsv(csv_path, paper.LATENCY_FIELDS).rows()) == 120
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many.csv", "r.csv"]


def test_other_scripts_take_figure9_10_s_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Figure 10b times its own welder but takes the baselines figure9_10.csv measured
    (an ok line only: a failed one is measured again); --no-reuse times them all."""
    calls: list[tuple[str, tuple[str, ...]]] = []
    monkeypatch.setattr(paper, "measure_case", fake_cells(calls))
    case = benchmark.Config("bert", 1, "fp16")
    shared = paper.ResultsCsv(tmp_path / "figure9_10.csv", paper.LATENCY_FIELDS)
    shared.put(paper.cell_row(case, "eager", benchmark.Cell(ms=7.25, detail="torch x"), "H100"))
    shared.put(paper.cell_row(case, "compile", benchmark.Cell(error="boom"), "H100"))
    argv = ["--models", "bert", "--bs", "1", "--device", "cpu", "--out", str(tmp_path)]
    argv += ["--systems", "welder-no-tc,eager,compile"]
    assert script("Figure10b").main(argv) == 0
    assert calls == [("bert_b1_fp16", ("welder-no-tc", "compile"))]
    rows = {r["system"]: r for r in paper.ResultsCsv(tmp_path / "figure10b.csv", paper.LATENCY_FIELDS).rows()}
    assert rows["eager"]["latency_ms"] == "7.25" and rows["eager"]["detail"] == "torch x; from figure9_10.csv"
    assert rows["compile"]["latency_ms"] == "2"
    assert script("Figure10b").main([*argv, "--redo"]) == 0
    assert calls[1:] == [("bert_b1_fp16", ("welder-no-tc", "eager", "compile"))]


@pytest.mark.parametrize(
    ("folder", "systems"), [("Figure9_10", "eager,compile"), ("Figure13", "welder-nofusion,welder")]
)
def test_a_line_lands_before_the_next_system_starts(
    folder: str, systems: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run stopped in the middle of a case (the machine's time up) keeps the systems it
    finished: each line is in the CSV before the next system is measured."""
    module = script(folder)

    def measure_case(
        case: benchmark.Config, systems: list[str], args: Any
    ) -> Iterator[tuple[str, benchmark.Cell]]:
        yield systems[0], benchmark.Cell(ms=1.0)
        raise KeyboardInterrupt  # stopped while measuring the second

    monkeypatch.setattr(paper, "measure_case", measure_case)
    argv = ["--models", "nerf", "--bs", "1", "--dtype", "fp32", "--device", "cpu", "--out", str(tmp_path)]
    with pytest.raises(KeyboardInterrupt):
        module.main([*argv, "--runs", str(tmp_path / "runs"), "--systems", systems])
    rows = paper.ResultsCsv(tmp_path / f"{module.NAME}.csv", paper.COMMON_FIELDS).rows()
    assert [r["system"] for r in rows] == systems.split(",")[:1] and rows[0]["latency_ms"] == "1"


def test_a_child_step_stops_with_what_it_started(tmp_path: Path) -> None:
    """A step past its limit is stopped with its whole process group: a grandchild
    (nvcc under welder tune, Inductor's workers under torch.compile) does not run on."""
    pid_file = tmp_path / "pid"
    with pytest.raises(benchmark.StepTimeout, match="timed out after"):
        benchmark._run_child(["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], 1.0)
    pid = int(pid_file.read_text())
    deadline = time.time() + 10
    while time.time() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid)


def test_a_logged_step_leaves_what_it_said_when_stopped(tmp_path: Path) -> None:
    """A step's log (the tune's) holds its stderr as written: a step stopped part way leaves
    the lines it wrote before, and one that ends returns the file's text as its stderr."""
    log = tmp_path / "tune.log"
    with pytest.raises(benchmark.StepTimeout):
        benchmark._run_child(["sh", "-c", "echo 'group 1 tuned' >&2; sleep 60"], 1.0, log=log)
    assert log.read_text() == "group 1 tuned\n"
    done = benchmark._run_child(["sh", "-c", "echo out; echo err >&2; exit 3"], 10.0, log=log)
    assert (done.returncode, done.stdout, done.stderr, log.read_text()) == (3, "out\n", "err\n", "err\n")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat")
    return not (state.is_file() and state.read_text().split(")")[-1].split()[0] == "Z")


def test_a_torch_peer_past_its_limit_is_an_error_naming_the_option(tmp_path: Path) -> None:
    parser = paper.build_parser("t", systems=("eager",))
    args = paper.parse_args(parser, ["--device", "cpu", "--peer-timeout-s", "0.01", "--runs", str(tmp_path)])
    cell = paper.torch_peer(tmp_path, "compile-max-autotune", args)
    assert cell.ms is None and "timed out after" in cell.error and "--peer-timeout-s" in cell.error


@pytest.mark.parametrize("compiled", [True, False])
def test_a_torch_peer_stopped_in_its_timing_keeps_its_compile_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiled: bool
) -> None:
    """A child that said its compile was done (run_torch's stderr line) and then ran past
    --peer-timeout-s: the error line keeps the compile's seconds, which Table 4 reads; one
    stopped before it said so has none.  The child is a real process, its stderr a file.
    Its caches are RUNS/inductor/CASE-SYSTEM, emptied before it starts (a cold compile)
    and kept after (for Figure 11's profile of the same compile)."""
    child = tmp_path / "child.py"
    said = "# compile-max-autotune compiled in 1.50 s" if compiled else "# still compiling"
    child.write_text(f"import sys, time\nprint({said!r}, file=sys.stderr, flush=True)\ntime.sleep(60)\n")
    export = tmp_path / "runs" / "exports" / "nerf_b1_fp32"
    folder = tmp_path / "runs" / "inductor" / "nerf_b1_fp32-compile-max-autotune"
    (folder / "inductor").mkdir(parents=True)
    (folder / "inductor" / "stale").write_text("an earlier compile's")
    run_child = benchmark._run_child
    seen: list[dict[str, str]] = []

    def instead(command, timeout_s, extra_env=None, log=None):
        seen.append(extra_env)
        assert not (folder / "inductor" / "stale").exists()
        Path(extra_env["TRITON_CACHE_DIR"]).mkdir(parents=True)
        return run_child([sys.executable, str(child)], timeout_s, extra_env, log)

    monkeypatch.setattr(benchmark, "_run_child", instead)
    parser = paper.build_parser("t", systems=("eager",))
    argv = ["--device", "cpu", "--peer-timeout-s", "3", "--runs", str(tmp_path / "runs")]
    args = paper.parse_args(parser, argv)
    cell = paper.torch_peer(export, "compile-max-autotune", args)
    assert cell.ms is None and "timed out after 3 s (--peer-timeout-s)" in cell.error
    if compiled:
        assert cell.build_s == 1.5 and cell.error.endswith("its compile done in 1.5 s")
    else:
        assert cell.build_s is None and "compile done" not in cell.error
    assert sorted(seen[0].values()) == [str(folder / "inductor"), str(folder / "triton")]
    assert (folder / "triton").is_dir()  # kept
    row = {"status": "error", "detail": cell.error}
    assert paper._bounds(row, 3) and not paper._bounds(row, 4)


NCU_HEADER = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
NCU_OUTPUT = f"""==PROF== Connected to process 123
some program output
{NCU_HEADER}"dram__bytes_read.sum","dram__bytes_write.sum","lts__t_sectors_srcunit_tex_op_write.sum"
"","","","","","","","Kbyte","byte","sector"
"0","123","python","h","gemm_kernel","1","7","1,024.5","2048","1,000"
"1","123","python","h","add_kernel","1","7","0.5","0","24"
==PROF== Disconnected from process 123
"""


def test_ncu_csv_gives_kernels_dram_bytes_and_l2_writes() -> None:
    """The kernels counted, the DRAM bytes scaled by their units line, and the L2 sectors
    written as 32-byte sectors."""
    fig11 = script("Figure11")
    kernels, read, written, l2_written = fig11.parse_ncu_csv(NCU_OUTPUT)
    assert (kernels, read, written, l2_written) == (2, 1025.0e3, 2048.0, 1024 * 32.0)
    with pytest.raises(ValueError, match="no ncu CSV"):
        fig11.parse_ncu_csv("==ERROR== ERR_NVGPUCTRPERM")
    command = fig11.ncu_command("ncu", "welder", Path("p"))
    metrics = "dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_write.sum"
    assert metrics in command and command[-2:] == ["welder", "p"]


def figure11_tool(name: str) -> ModuleType:
    return paper.script_module("Figure11", name)


def check_l2_metric() -> ModuleType:
    return figure11_tool("check_l2_metric")


#: One inference as ncu times it: group_0's kernel twice, a library kernel no group names,
#: group_1's once (durations in ns, the units line's).
CONTEXT_NCU = (
    "==PROF== Connected to process 9\n"
    + NCU_HEADER
    + '"gpu__time_duration.sum"\n"","","","","","","","nsecond"\n'
    + '"0","9","python","h","welder_k0_a(float const*, float*)","1","7","5,000"\n'
    + '"1","9","python","h","sm90_xmma_gemm","1","7","3000"\n'
    + '"2","9","python","h","welder_k1_b","1","7","9000"\n'
    + '"3","9","python","h","welder_k0_a(float const*, float*)","1","7","6000"\n'
)
CONTEXT_TUNED = {
    "groups": [
        {
            "name": "group_0",
            "ops": ["MatMul", "Add", "Add"],
            "measured_latency_us": 4.0,
            "kernel": {"name": "welder_k0_a"},
        },
        {
            "name": "group_1",
            "ops": ["Softmax"],
            "measured_latency_us": 10.0,
            "kernel": {"name": "welder_k1_b"},
        },
        {"name": "group_2", "ops": ["MatMul"], "measured_latency_us": 2.0, "kernel": None},
    ],
    "totals": {"measured_runtime_us": 30.0},
}


def test_kernel_context_sets_each_launch_beside_its_time_alone() -> None:
    """Each profiled kernel matched by name (parameters dropped) to its group, durations
    from ns to us; a kernel no group names stays apart; the report's sums are the
    matched launches' and the worst launch comes first."""
    tool = figure11_tool("kernel_context")
    kernels = tool.FIGURE11.ncu_named_kernels(CONTEXT_NCU, [tool.METRIC])
    placed = tool.place(kernels, CONTEXT_TUNED)
    got = [(p.group, p.alone_us, round(p.placed_us, 6)) for p in placed]
    assert got == [("group_0", 4.0, 5.0), (None, None, 3.0), ("group_1", 10.0, 9.0), ("group_0", 4.0, 6.0)]
    assert placed[0].ops == "MatMul Add"
    lines = tool.report(placed, CONTEXT_TUNED["totals"], top=2)
    assert lines[0] == "4 kernels in one inference, 3 of them the plan's groups"
    assert "18.0 us" in lines[1] and "20.0 us" in lines[2] and "+3.0 us in other kernels" in lines[2]
    assert "30.0 us" in lines[3]
    assert [line.split()[0] for line in lines[6:]] == ["group_0", "group_0"]
    assert lines[6].split()[3] == "+2.00"


@pytest.mark.parametrize("unit, factor", [("nsecond", 1e-9), ("ns", 1e-9), ("us", 1e-6), ("msecond", 1e-3)])
def test_ncu_durations_scale_by_their_unit_and_an_unknown_unit_is_an_error(unit: str, factor: float) -> None:
    """Both spellings ncu has used for its time units scale; a unit Figure 11 does not know
    stops the parse, naming it, rather than being read as a factor of 1."""
    fig11 = script("Figure11")
    text = CONTEXT_NCU.replace('"nsecond"', f'"{unit}"')
    kernels = fig11.ncu_named_kernels(text, ["gpu__time_duration.sum"])
    assert [values[0] for _, values in kernels] == pytest.approx(
        [5000 * factor, 3000 * factor, 9000 * factor, 6000 * factor]
    )
    with pytest.raises(ValueError, match="'fortnight'"):
        fig11.ncu_named_kernels(CONTEXT_NCU.replace('"nsecond"', '"fortnight"'), ["gpu__time_duration.sum"])


def test_kernel_context_runs_ncu_on_the_build_and_says_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tool = figure11_tool("kernel_context")
    assert tool.main([str(tmp_path)]) == 2
    assert "tuned.json not found" in capsys.readouterr().err
    (tmp_path / "tuned.json").write_text(json.dumps(CONTEXT_TUNED))
    monkeypatch.setattr(tool.shutil, "which", lambda name: None)
    assert tool.main([str(tmp_path)]) == 2
    assert "ncu not found" in capsys.readouterr().err
    commands: list[list[str]] = []

    def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        return subprocess.CompletedProcess(command, 0, CONTEXT_NCU, "")

    monkeypatch.setattr(tool.subprocess, "run", run)
    out = tmp_path / "launches.json"
    assert tool.main([str(tmp_path), "--ncu", "/x/ncu", "--json", str(out)]) == 0
    assert commands[0][0] == "/x/ncu" and commands[0][-2:] == ["welder", str(tmp_path)]
    assert "--cache-control" in commands[0] and "none" in commands[0]
    assert "4 kernels in one inference" in capsys.readouterr().out
    assert [launch["group"] for launch in json.loads(out.read_text())] == [
        "group_0",
        None,
        "group_1",
        "group_0",
    ]
    monkeypatch.setattr(
        tool.subprocess,
        "run",
        lambda c, **k: subprocess.CompletedProcess(c, 1, "", "==ERROR== ERR_NVGPUCTRPERM"),
    )
    assert tool.main([str(tmp_path), "--ncu", "/x/ncu"]) == 2
    assert "ERR_NVGPUCTRPERM" in capsys.readouterr().err


def l2_check_csv(counts: list[tuple[int, int]]) -> str:
    """ncu's raw CSV of kernels with (Figure 11's counter, all sources) sectors each."""
    check = check_l2_metric()
    lines = [f'{NCU_HEADER}"{check.COUNTER}","{check.ALL_SOURCES}"', '"","","","","","","","sector","sector"']
    lines += [f'"{i}","1","python","h","k{i}","1","7","{a:,}","{b:,}"' for i, (a, b) in enumerate(counts)]
    return "\n".join(["==PROF== Connected", *lines, "==PROF== Disconnected"])


def l2_kernels(counts: list[tuple[int, int]]) -> list[list[float]]:
    """Each kernel's bytes by the two counters, as the check reads them from ncu."""
    check = check_l2_metric()
    return check.FIGURE11.ncu_kernels(l2_check_csv(counts), check.METRICS)


def test_l2_metric_check_compares_each_write_with_its_bytes() -> None:
    """Sectors that match each write's bytes pass; the all-sources count's 1.5x, or a
    missing kernel, fail; a matmul's second kernel counts towards the matmul."""
    check = check_l2_metric()
    exact = [size // 32 for _, size in check.WRITES]
    kernels = l2_kernels([(n, n * 3 // 2) for n in exact])
    assert [k[0] for k in kernels] == [32.0 * n for n in exact]
    lines, ok = check.compare(kernels)
    assert ok and "(1.50x)" in lines[1] and "matches" in lines[-1]
    _, ok = check.compare(l2_kernels([(n * 3 // 2, n * 3 // 2) for n in exact]))
    assert not ok
    split = [(exact[0], 0), (exact[1], 0), (exact[2] - 100, 0), (100, 0)]
    assert check.compare(l2_kernels(split))[1]
    assert not check.compare(l2_kernels(split[:2]))[1]


def test_l2_metric_check_without_ncu_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    check = check_l2_metric()
    monkeypatch.setattr(check.shutil, "which", lambda name: None)
    assert check.main([]) == 2
    assert "ncu not found" in capsys.readouterr().err


def test_figure11_profiles_what_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Systems that ran get ncu's columns (here faked); the others say why not."""
    fig11 = script("Figure11")
    monkeypatch.setattr(paper, "measure_case", fake_cells([]))
    seen: list[tuple[str, Path]] = []

    def profile(system: str, prefix: Path, args: Any) -> dict[str, Any]:
        seen.append((system, prefix))
        return {
            "kernels": 7,
            "dram_read_bytes": 2e6,
            "dram_write_bytes": 1e6,
            "l2_write_bytes": 3e6,
            "profile": "ncu",
        }

    monkeypatch.setattr(fig11, "profile", profile)
    monkeypatch.setattr(
        paper, "built_variant", lambda case, system, args: (Path(args.runs) / system / case.key, False)
    )
    monkeypatch.setattr(paper, "export_case", lambda case, args: Path(args.runs) / "exports" / case.key)
    argv = ["--models", "bert", "--bs", "1", "--dtype", "fp16", "--device", "cpu", "--out", str(tmp_path)]
    assert fig11.main([*argv, "--runs", str(tmp_path / "runs")]) == 0
    rows = {r["system"]: r for r in paper.ResultsCsv(tmp_path / "figure11.csv", fig11.FIELDS).rows()}
    assert rows["welder"]["kernels"] == "7" and rows["welder"]["dram_read_bytes"] == "2e+06"
    assert rows["welder"]["l2_write_bytes"] == "3e+06"
    assert rows["onnxruntime"]["profile"] == "not profiled: absent" and not rows["onnxruntime"]["kernels"]
    assert (tmp_path / "runs" / "welder-nofusion" / "bert_b1_fp16") in [p for _, p in seen]
    assert (tmp_path / "runs" / "exports" / "bert_b1_fp16") in [p for _, p in seen]
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "figure11_fp16_b1.png").is_file()


@pytest.mark.parametrize("system", ["compile-max-autotune", "compile", "eager"])
def test_figure11_compiles_torch_compile_outside_ncu_into_caches_the_profile_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, system: str
) -> None:
    """A torch.compile system runs once outside ncu first, into the caches its timing
    compiled into (what that compile left is kept: the kernels timed are the ones
    profiled), and ncu's run reads the same caches; eager has nothing to compile and goes
    to ncu directly.  A compile past --peer-timeout-s is the profile's error, with no ncu
    run."""
    fig11 = script("Figure11")
    calls: list[tuple[list[str], dict[str, str]]] = []
    timed = tmp_path / "runs" / "inductor" / f"bert_b1_fp16-{system}" / "triton" / "kernel.cubin"

    def run_child(command: Any, timeout_s: float, env: dict[str, str] | None = None) -> Any:
        calls.append((list(command), dict(env or {})))
        assert timed.is_file()
        return subprocess.CompletedProcess(command, 0, NCU_OUTPUT if command[0] == "ncu" else "", "")

    monkeypatch.setattr(fig11.benchmark, "_run_child", run_child)
    timed.parent.mkdir(parents=True)
    timed.write_text("a kernel of the timing's compile")
    args = argparse.Namespace(
        device="cuda", ncu="ncu", runs=str(tmp_path / "runs"), peer_timeout_s=240.0, profile_timeout_s=240.0
    )
    prefix = tmp_path / "runs" / "exports" / "bert_b1_fp16"
    assert fig11.profile(system, prefix, args)["profile"] == "ncu"
    if system == "eager":
        assert [c[0][0] for c in calls] == ["ncu"]
        return
    (warm, warm_env), (ncu, ncu_env) = calls
    assert warm[0] != "ncu" and warm[1].endswith("profile_once.py") and warm[2:] == [system, str(prefix)]
    assert ncu[0] == "ncu" and ncu[-2:] == [system, str(prefix)]
    assert warm_env["TRITON_CACHE_DIR"] == str(timed.parent)
    for key in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert warm_env[key].startswith(str(timed.parent.parent)) and ncu_env[key] == warm_env[key]
    assert ncu_env["TORCHINDUCTOR_COMPILE_THREADS"] == "1"

    def too_long(command: Any, timeout_s: float, env: dict[str, str] | None = None) -> Any:
        if command[0] == "ncu":
            raise AssertionError("ncu ran after a compile that did not finish")
        raise fig11.benchmark.StepTimeout(f"timed out after {timeout_s:.0f} s")

    monkeypatch.setattr(fig11.benchmark, "_run_child", too_long)
    cell = fig11.profile(system, prefix, args)
    assert cell["profile"].startswith("error: its compile outside ncu timed out after 240 s")
    assert "--peer-timeout-s" in cell["profile"]


@pytest.mark.parametrize("remade", [False, True])
def test_figure11_times_a_remade_build_it_profiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, remade: bool
) -> None:
    """figure9_10.csv's welder line stands only beside a profile of the build it timed: a
    build the tuning cache made again here (perhaps another plan) is timed here too."""
    fig11 = script("Figure11")
    case = benchmark.Config("bert", 1, "fp16")
    shared = paper.ResultsCsv(tmp_path / "figure9_10.csv", paper.LATENCY_FIELDS)
    shared.put(paper.cell_row(case, "welder", benchmark.Cell(ms=9.0, detail="older plan"), "H100"))
    timed: list[Path] = []

    def welder_cell(prefix: Path, system: str, args: Any) -> benchmark.Cell:
        timed.append(prefix)
        return benchmark.Cell(ms=4.5, detail="this plan")

    prefix = tmp_path / "runs" / "welder" / case.key
    monkeypatch.setattr(paper, "measure_case", fake_cells([]))
    monkeypatch.setattr(paper, "welder_cell", welder_cell)
    monkeypatch.setattr(paper, "built_variant", lambda case, system, args: (prefix, remade))
    monkeypatch.setattr(fig11, "profile", lambda system, prefix, args: {"kernels": 7, "profile": "ncu"})
    argv = ["--models", "bert", "--bs", "1", "--dtype", "fp16", "--device", "cpu", "--out", str(tmp_path)]
    assert fig11.main([*argv, "--systems", "welder"]) == 0
    (row,) = paper.ResultsCsv(tmp_path / "figure11.csv", fig11.FIELDS).rows()
    assert row["kernels"] == "7"
    if remade:
        assert timed == [prefix] and row["latency_ms"] == "4.5" and row["detail"] == "this plan"
    else:
        assert timed == [] and row["latency_ms"] == "9" and row["detail"] == "older plan; from figure9_10.csv"


def _fake_plan(prefix: Path) -> None:
    """tuned.json and model.json of a two-group plan over three float32 nodes: a [4, 8]
    matmul output fused into the group of its activation, which is the model output."""
    prefix.mkdir(parents=True, exist_ok=True)
    nodes = [
        {"name": "mm", "shape": [4, 8], "dtype": "float32"},
        {"name": "act", "shape": [4, 8], "dtype": "float32"},
        {"name": "out", "shape": [4, 8], "dtype": "float16"},
    ]
    (prefix / "model.json").write_text(json.dumps({"nodes": nodes, "outputs": [{"name": "out"}]}))
    groups = [
        {"outputs": ["act"], "candidates": 12, "from_cache": False},
        {"outputs": ["out"], "candidates": 3, "from_cache": True},
    ]
    totals = {"kernels": 2, "library_calls": 0, "traffic_bytes": 500, "unfused_kernels": 3}
    totals |= {"unfused_traffic_bytes": 900, "unfused_latency_us": 30.0, "unfused_basis": "measured"}
    (prefix / "tuned.json").write_text(json.dumps({"groups": groups, "totals": totals}))


def test_figure13_reads_kernels_and_intermediate_bytes_from_the_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fig13 = script("Figure13")
    facts = fig13.plan_facts(_plan_dir(tmp_path))
    assert facts["kernels"] == 2 and facts["intermediate_bytes"] == 128 and facts["traffic_bytes"] == 500
    assert facts["per_op_kernels"] == 3 and facts["per_op_intermediate_bytes"] == 256
    assert facts["per_op_latency_ms"] == 0.03 and "measured" in facts["per_op_basis"]

    monkeypatch.setattr(paper, "measure_case", fake_cells([]))
    for system in ("welder", "welder-nofusion"):
        _fake_plan(tmp_path / "runs" / system / "nerf_b1_fp32")
    argv = ["--models", "nerf", "--bs", "1", "--dtype", "fp32", "--device", "cpu"]
    assert fig13.main([*argv, "--out", str(tmp_path), "--runs", str(tmp_path / "runs")]) == 0
    rows = {r["system"]: r for r in paper.ResultsCsv(tmp_path / "figure13.csv", fig13.FIELDS).rows()}
    assert set(rows) == {"per-op", "welder-nofusion", "welder"}
    assert rows["per-op"]["kernels"] == "3" and rows["per-op"]["latency_ms"] == "0.03"
    assert rows["welder"]["latency_ms"] == "1" and rows["welder"]["latency_basis"] == "runtime end to end"


def test_table4_counts_the_candidates_the_tuner_timed(tmp_path: Path) -> None:
    """The tuner's own count wins; a warm run that timed nothing says 0, not the counts
    its cached groups carry."""
    table4 = script("Table4")
    prefix = _plan_dir(tmp_path)
    tuned = json.loads((prefix / "tuned.json").read_text())
    for work, want in (({"candidates timed": 40.0}, 40), ({"groups tuned": 0.0}, 0)):
        tuned["totals"]["tuning_work"] = work
        (prefix / "tuned.json").write_text(json.dumps(tuned))
        assert table4.plan_counts(prefix)["candidates"] == want


def _plan_dir(tmp_path: Path) -> Path:
    _fake_plan(tmp_path / "plan")
    return tmp_path / "plan"


def test_table4_tunes_cold_then_warm_on_one_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cold empties the case's cache before tuning, warm tunes again on it, each in a
    prefix of its own (the cold run's tuned.json is not overwritten); candidates come from
    tuned.json; max-autotune's compile time is its cell's build time."""
    table4 = script("Table4")
    runs = tmp_path / "runs"
    export = runs / "exports" / "nerf_b1_fp32"
    export.mkdir(parents=True)
    (export / "export.json").write_text("{}")
    (export / "model.onnx").write_text("")
    tunes: list[tuple[Path, bool]] = []
    prefixes: list[Path] = []

    def tune_and_build(prefix: Path, options: Any) -> tuple[float, float]:
        tunes.append((options.cache_dir, (options.cache_dir / "entry").exists()))
        assert not (prefix / "tuned.json").exists()  # a prefix of its own, not the cold run's
        prefixes.append(prefix)
        options.cache_dir.mkdir(parents=True, exist_ok=True)
        (options.cache_dir / "entry").write_text("x")
        _fake_plan(prefix)
        return 10.0, 2.0

    monkeypatch.setattr(benchmark, "tune_and_build", tune_and_build)
    monkeypatch.setattr(paper, "export_case", lambda case, args: export)
    monkeypatch.setattr(
        paper, "torch_peer", lambda prefix, system, args: benchmark.Cell(ms=0.5, build_s=99.0)
    )
    argv = ["--models", "nerf", "--bs", "1", "--dtype", "fp32", "--device", "cpu", "--out", str(tmp_path)]
    (runs / "table4-cache" / "nerf_b1_fp32").mkdir(parents=True)
    (runs / "table4-cache" / "nerf_b1_fp32" / "entry").write_text("stale")
    assert table4.main([*argv, "--runs", str(runs)]) == 0
    assert [warm for _, warm in tunes] == [False, True]
    assert len({cache for cache, _ in tunes}) == 1
    assert [p.parent.name for p in prefixes] == ["table4-cold", "table4-warm"]
    assert all((p / "tuned.json").is_file() for p in prefixes)
    rows = {r["system"]: r for r in paper.ResultsCsv(tmp_path / "table4.csv", table4.FIELDS).rows()}
    assert rows["welder-cold"]["build_s"] == "12" and rows["welder-cold"]["tune_s"] == "10"
    # the cached group's 3 candidates were timed by another run
    assert rows["welder-cold"]["candidates"] == "12" and rows["welder-warm"]["cached_groups"] == "1"
    assert rows["compile-max-autotune"]["build_s"] == "99" and rows["compile-max-autotune"]["status"] == "ok"
    assert table4.main([*argv, "--runs", str(runs)]) == 0 and len(tunes) == 2  # resumed: nothing new


def test_table4_takes_figure9_s_max_autotune_line_only_if_it_compiled_cold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Figure 9 max-autotune line whose note says its compile was cold is Table 4's cold
    compile (no export, no compile of its own); one without that note, or --no-reuse, is
    compiled again.  Every torch peer runs with Inductor's and Triton's caches in folders of
    its own, empty at its start."""
    table4 = script("Table4")
    figure9 = paper.ResultsCsv(tmp_path / "figure9_10.csv", paper.LATENCY_FIELDS)
    cold = benchmark.Cell(ms=0.7, build_s=310.0, detail=f"{run_torch.COLD_NOTE}; tf32=False")
    figure9.put(paper.cell_row(benchmark.Config("nerf", 1, "fp32"), "compile-max-autotune", cold, "G"))
    warm = benchmark.Cell(ms=0.7, build_s=31.0, detail="tf32=False")
    figure9.put(paper.cell_row(benchmark.Config("nerf", 1, "fp16"), "compile-max-autotune", warm, "G"))
    peers: list[tuple[str, dict[str, str] | None]] = []

    def run_child(command, timeout_s, extra_env=None, log=None):
        assert sorted(extra_env) == sorted(run_torch.CACHE_ENVS)
        assert not any(Path(folder).exists() for folder in extra_env.values())
        assert len({Path(folder).parent for folder in extra_env.values()}) == 1
        peers.append((command[command.index("--systems") + 1], extra_env))
        raise benchmark.StepTimeout("stopped here")

    exports: list[str] = []
    (tmp_path / "export").mkdir()
    for name in ("export.json", "model.onnx"):
        (tmp_path / "export" / name).write_text("{}")

    def export_case(case, args):
        exports.append(case.key)
        return tmp_path / "export"

    monkeypatch.setattr(benchmark, "_run_child", run_child)
    monkeypatch.setattr(paper, "export_case", export_case)
    argv = ["--models", "nerf", "--bs", "1", "--device", "cpu", "--out", str(tmp_path)]
    argv += ["--systems", "compile-max-autotune", "--runs", str(tmp_path / "runs")]
    assert table4.main(argv) == 0
    rows = {r["dtype"]: r for r in paper.ResultsCsv(tmp_path / "table4.csv", table4.FIELDS).rows()}
    assert rows["fp32"]["build_s"] == "310" and rows["fp32"]["status"] == "ok"
    assert "from figure9_10.csv" in rows["fp32"]["detail"]
    assert rows["fp16"]["status"] == "error" and exports == ["nerf_b1_fp16"]
    assert [system for system, _ in peers] == ["compile-max-autotune"]
    assert table4.main([*argv, "--no-reuse", "--redo", "--dtype", "fp32"]) == 0
    assert len(peers) == 2 and exports[-1] == "nerf_b1_fp32"


def test_table4_takes_figure9_s_max_autotune_timeout_as_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A max-autotune that ran past Figure 9's --peer-timeout-s is Table 4's line as it is
    (its compile takes longer than that limit, or, stopped in its timing, the compile time
    it kept); other Figure 9 errors are compiled again."""
    table4 = script("Table4")
    figure9 = paper.ResultsCsv(tmp_path / "figure9_10.csv", paper.LATENCY_FIELDS)
    late = benchmark.Cell(error=f"compile-max-autotune timed out after 200 s {paper.PEER_TIMEOUT}")
    figure9.put(paper.cell_row(benchmark.Config("nerf", 1, "fp32"), "compile-max-autotune", late, "G"))
    timing = benchmark.Cell(error=f"{late.error}, its compile done in 95.2 s", build_s=95.25)
    vit = benchmark.Config("vit_small_p32", 1, "fp32")
    figure9.put(paper.cell_row(vit, "compile-max-autotune", timing, "G"))
    crashed = benchmark.Cell(error="run_torch exit 1: CUDA out of memory")
    figure9.put(paper.cell_row(benchmark.Config("nerf", 1, "fp16"), "compile-max-autotune", crashed, "G"))
    exports: list[str] = []

    def export_case(case, args):
        exports.append(case.key)
        raise RuntimeError("not exported here")

    monkeypatch.setattr(paper, "export_case", export_case)
    argv = ["--models", "nerf", "--bs", "1", "--device", "cpu", "--out", str(tmp_path)]
    argv += ["--systems", "compile-max-autotune", "--runs", str(tmp_path / "runs"), "--peer-timeout-s", "200"]
    assert table4.main(argv) == 0
    rows = {r["dtype"]: r for r in paper.ResultsCsv(tmp_path / "table4.csv", table4.FIELDS).rows()}
    assert rows["fp32"]["status"] == "error" and "timed out after 200 s" in rows["fp32"]["detail"]
    assert "from figure9_10.csv" in rows["fp32"]["detail"]
    assert exports == ["nerf_b1_fp16"] and "export failed" in rows["fp16"]["detail"]
    assert table4.main(["--models", "vit_small_p32", *argv[2:], "--dtype", "fp32"]) == 0
    vit = paper.ResultsCsv(tmp_path / "table4.csv", table4.FIELDS).get(
        benchmark.Config("vit_small_p32", 1, "fp32"), "compile-max-autotune"
    )
    assert vit["build_s"] == "95.25" and "its compile done in 95.2 s" in vit["detail"]
    assert exports == ["nerf_b1_fp16"]
    # given longer than Figure 9 had, it compiles again
    assert table4.main([*argv[:-1], "600", "--retry-errors"]) == 0
    assert exports == ["nerf_b1_fp16", "nerf_b1_fp32", "nerf_b1_fp16"]


def test_a_peer_timeout_in_figure9_is_every_script_s_line_up_to_its_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Figure 11 (as every script) takes Figure 9's max-autotune that ran out a limit at
    least its own, and profiles nothing of it; with a longer limit it measures it again."""
    fig11 = script("Figure11")
    case = benchmark.Config("bert", 1, "fp16")
    late = benchmark.Cell(error=f"compile-max-autotune timed out after 240 s {paper.PEER_TIMEOUT}")
    paper.ResultsCsv(tmp_path / "figure9_10.csv", paper.LATENCY_FIELDS).put(
        paper.cell_row(case, "compile-max-autotune", late, "G")
    )
    calls: list[tuple[str, tuple[str, ...]]] = []
    monkeypatch.setattr(paper, "measure_case", fake_cells(calls))
    argv = ["--models", "bert", "--bs", "1", "--dtype", "fp16", "--device", "cpu", "--out", str(tmp_path)]
    argv += ["--systems", "compile-max-autotune"]
    assert fig11.main([*argv, "--peer-timeout-s", "240"]) == 0
    (row,) = paper.ResultsCsv(tmp_path / "figure11.csv", fig11.FIELDS).rows()
    assert (
        calls == [] and "timed out after 240 s" in row["detail"] and row["profile"] == "not profiled: error"
    )
    assert fig11.main([*argv, "--peer-timeout-s", "241", "--retry-errors"]) == 0
    assert calls == [("bert_b1_fp16", ("compile-max-autotune",))]


def test_table5_defaults_are_the_compute_intensive_cases(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[tuple[str, tuple[str, ...]]] = []
    monkeypatch.setattr(paper, "measure_case", fake_cells(calls))
    assert script("Table5").main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    assert [k for k, _ in calls] == [
        "resnet50_b64_fp32",
        "resnet50_b64_fp16",
        "bert_b64_fp32",
        "bert_b64_fp16",
    ]
    assert calls[0][1][:2] == ("welder", "welder-skip-dot")


# -- on the CPU, with torch ------------------------------------------------------------------


@pytest.mark.slow
def test_figure9_10_smoke_run_on_the_cpu(tmp_path: Path) -> None:
    """The real script on a tiny NeRF: eager and onnxruntime timed on the CPU, welder
    planned from the H100 cost model (absent, with its plan time); run again, it skips."""
    need("torch")
    cmd = [
        sys.executable,
        "artifacts/Figure9_10/run_all.py",
        "--models",
        "nerf",
        "--bs",
        "1",
        "--dtype",
        "fp32",
    ]
    cmd += ["--systems", "welder,eager,onnxruntime", "--device", "cpu", "--budget-s", "0.2"]
    cmd += [
        "--out",
        str(tmp_path / "out"),
        "--runs",
        str(tmp_path / "runs"),
        "--cache-dir",
        str(tmp_path / "c"),
    ]
    cmd += ["--model-options", TINY]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = {
        r["system"]: r
        for r in paper.ResultsCsv(tmp_path / "out" / "figure9_10.csv", paper.LATENCY_FIELDS).rows()
    }
    assert rows["eager"]["status"] == "ok" and float(rows["eager"]["latency_ms"]) > 0
    assert rows["onnxruntime"]["status"] == "ok" and rows["onnxruntime"]["detail"] == "onnxruntime-cpu"
    assert rows["welder"]["status"] == "absent" and float(rows["welder"]["build_s"]) > 0
    assert (tmp_path / "runs" / "welder" / "nerf_b1_fp32" / "tuned.json").is_file()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0 and "[nerf_b1_fp32] in figure9_10.csv, skipped" in proc.stderr


@pytest.mark.slow
def test_gpus_hands_each_case_to_a_worker_and_they_share_the_csv(tmp_path: Path) -> None:
    """--gpus 2 on two cases: each runs in a worker of its own on its own GPU index (here
    timed on the CPU), both lines land in the one CSV, and the parent draws the table."""
    need("torch")
    cmd = [sys.executable, "artifacts/Figure9_10/run_all.py", "--models", "nerf", "--bs", "1"]
    cmd += ["--dtype", "fp32,fp16", "--systems", "eager", "--device", "cpu", "--budget-s", "0.2"]
    cmd += ["--out", str(tmp_path / "out"), "--runs", str(tmp_path / "runs"), "--model-options", TINY]
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    proc = subprocess.run(
        [*cmd, "--gpus", "2"], capture_output=True, text=True, cwd=ROOT, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "[nerf_b1_fp32] started on GPU 0" in proc.stderr and "[nerf_b1_fp16] started on GPU 1" in proc.stderr
    )
    rows = paper.ResultsCsv(tmp_path / "out" / "figure9_10.csv", paper.LATENCY_FIELDS).rows()
    assert sorted((r["dtype"], r["status"]) for r in rows) == [("fp16", "ok"), ("fp32", "ok")]
    assert "| nerf | 1 | fp16 |" in (tmp_path / "out" / "figure9_10.md").read_text()
    assert len(json.loads((tmp_path / "out" / "figure9_10.meta.json").read_text())["runs"]) == 1


@pytest.mark.slow
def test_figure13_smoke_run_counts_the_plans_kernels(tmp_path: Path) -> None:
    """On the CPU the plans come from the H100 cost model: fusion leaves fewer kernels and
    intermediate bytes than --nofusion, which leaves fewer than one kernel per op."""
    need("torch")
    fig13 = script("Figure13")
    argv = ["--models", "nerf", "--bs", "1", "--dtype", "fp32", "--device", "cpu", "--model-options", TINY]
    argv += ["--out", str(tmp_path), "--runs", str(tmp_path / "runs"), "--cache-dir", str(tmp_path / "c")]
    assert fig13.main(argv) == 0
    rows = {r["system"]: r for r in paper.ResultsCsv(tmp_path / "figure13.csv", fig13.FIELDS).rows()}
    kernels = [int(rows[s]["kernels"]) for s in ("per-op", "welder-nofusion", "welder")]
    assert kernels[0] > kernels[1] > kernels[2] >= 1
    inter = [int(rows[s]["intermediate_bytes"]) for s in ("per-op", "welder-nofusion", "welder")]
    assert inter[0] > inter[1] > inter[2]


@pytest.mark.parametrize(
    ("folder", "expected"),
    [
        (
            "Figure11",
            {
                "latency (ms, log)": lambda r: float(r["latency_ms"]) if r["status"] == "ok" else None,
                "kernels per inference (log)": lambda r: float(r["kernels"]),
                "DRAM read + written (MB, log)": lambda r: (
                    (float(r["dram_read_bytes"]) + float(r["dram_write_bytes"])) / 1e6
                ),
                "written to L2 (MB, log)": lambda r: float(r["l2_write_bytes"]) / 1e6,
            },
        ),
        (
            "Figure13",
            {
                "kernels per inference (log)": lambda r: float(r["kernels"]),
                "intermediate tensors (MB, log)": lambda r: float(r["intermediate_bytes"]) / 1e6,
                "latency (ms, log)": lambda r: float(r["latency_ms"]),
            },
        ),
        ("Table4", {"compile time (s, log)": lambda r: float(r["build_s"])}),
    ],
)
def test_each_plot_draws_the_csv_s_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, folder, expected):
    """The bars of every pane are the CSV cells of their (model, system) in the panel's dtype
    and batch (scaled as labelled); a failed latency draws no bar."""
    need("matplotlib")
    module = script(folder)
    rows = []
    for k, (model, system) in enumerate((m, s) for m in ("bert", "nerf") for s in module.SYSTEMS):
        for bs in ("1", "64"):  # the batch-64 rows must not leak into the batch-1 picture
            rows.append(
                {
                    **{f: "" for f in module.FIELDS},
                    **dict(model=model, bs=bs, dtype="fp16", system=system, gpu="Test GPU"),
                    "status": "error" if k == 1 else "ok",
                    "latency_ms": str(1.5 + k + int(bs)),
                    "build_s": str(10 + k + int(bs)),
                    "kernels": str(3 + k + int(bs)),
                    "intermediate_bytes": str((7 + k + int(bs)) * 1e6),
                    "dram_read_bytes": str((2 + k + int(bs)) * 1e6),
                    "dram_write_bytes": str((1 + k) * 1e6),
                    "l2_write_bytes": str((5 + k + int(bs)) * 1e6),
                }
            )
    drawn: dict[str, dict[tuple[str, str], float | None]] = {}
    real = paper.grouped_bars

    def record(ax, groups, series, value, ylabel, log=False):
        if "_b1.png" in str(current[0]):
            drawn[ylabel] = {(m, s): value(m, s) for m in groups for s in series}
        return real(ax, groups, series, value, ylabel=ylabel, log=log)

    current: list[Path] = [Path()]
    panels = paper.panels

    def tracked(rows_, out, stem):
        for panel in panels(rows_, out, stem):
            current[0] = panel.png
            yield panel

    monkeypatch.setattr(paper, "grouped_bars", record)
    monkeypatch.setattr(paper, "panels", tracked)
    args = type("Args", (), {"systems": module.SYSTEMS, "out": tmp_path})()
    module.plot(rows, args)
    assert set(drawn) == set(expected)
    by_key = {(r["model"], r["system"]): r for r in rows if r["bs"] == "1"}
    for label, want in expected.items():
        assert drawn[label] == {key: want(row) for key, row in by_key.items()}, label
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        f"{module.NAME}_fp16_b1.png",
        f"{module.NAME}_fp16_b64.png",
    ]


def test_a_batch_64_panel_leaves_out_the_batch_1_only_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model not measured yet keeps its place (a placeholder) in every panel, but NeRF,
    which has no batch-64 case, gets none in a batch-64 picture."""
    monkeypatch.setattr(paper, "pyplot", lambda png: object())
    rows = [
        {"model": m, "bs": bs, "dtype": "fp16", "system": "welder", "gpu": "G"}
        for m, bs in (("nerf", "1"), ("bert", "1"), ("bert", "64"), ("restormer", "1"))
    ]
    got = {p.bs: p.models for p in paper.panels(rows, tmp_path, "fig")}
    assert got == {"1": ["bert", "restormer", "nerf"], "64": ["bert", "restormer"]}


def test_side_by_side_refuses_a_spec_it_cannot_run(tmp_path: Path) -> None:
    """Each argument must name a GPU and a script of artifacts/: a bad one stops the run
    before any script starts (exit 2, naming it), and no argument prints the usage."""
    runner = ROOT / "scripts" / "paper_side_by_side.sh"
    env = dict(os.environ, OUT=str(tmp_path))
    for args, said in (
        ([], "usage:"),
        (["0|Figure99|--bs 1"], "'0|Figure99|--bs 1'"),
        (["x|Table5|"], "'x|Table5|'"),
    ):
        proc = subprocess.run(
            ["bash", str(runner), *args], capture_output=True, text=True, env=env, timeout=60
        )
        assert proc.returncode == 2 and said in proc.stderr
    assert not list(tmp_path.glob("log_*.txt"))


def test_side_by_side_asks_each_script_what_it_would_measure_first(tmp_path: Path) -> None:
    """Before any GPU starts, a spec the script refuses (an unknown model) stops the run,
    naming the spec and the script's reason; PREFLIGHT_ONLY=1 lists what each spec would
    measure and stops there, launching nothing."""
    runner = ROOT / "scripts" / "paper_side_by_side.sh"
    env = dict(os.environ, OUT=str(tmp_path / "out"), PAPER_RESULTS=str(tmp_path))
    bad = "0|Figure13|--models swin_transformer --bs 64"
    proc = subprocess.run(["bash", str(runner), bad], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and bad in proc.stderr and "swin_transformer" in proc.stderr.splitlines()[-1]
    good = "0|Figure13|--models nerf --bs 1 --dtype fp16"
    env["PREFLIGHT_ONLY"] = "1"
    proc = subprocess.run(["bash", str(runner), good], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and f"{good}: 1 case(s) to measure" in proc.stdout
    assert not list((tmp_path / "out").glob("log_*.txt"))


def test_each_long_step_of_a_case_says_when_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Tune, build and test_acc print a line each on stderr as they end, with their time:
    a case cut short by a machine's time limit (Restormer at batch 64 ran 540 s without a
    line) still tells which step it was in."""
    prefix = tmp_path / "restormer_b64_fp32"
    prefix.mkdir()
    steps: list[str] = []
    monkeypatch.setattr(benchmark, "_python", lambda args, *_, **__: steps.append(args[2]) or "")
    options = benchmark.WelderOptions(tune_args=("--topk", "4"))
    benchmark.tune_and_build(prefix, options)
    assert steps == ["tune", "build"]
    monkeypatch.setattr(benchmark, "check_accuracy", lambda *a, **k: benchmark.Accuracy("FAIL", 3e-3))
    monkeypatch.setattr(benchmark, "run_main_test", lambda *a: (None, "stopped"))
    monkeypatch.setattr(benchmark, "_python", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("late")))
    with pytest.raises(RuntimeError):
        benchmark.measure_built(prefix, options, 1.0, 1.0)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("[restormer_b64_fp32]")]
    assert lines[0].startswith("[restormer_b64_fp32] welder tune --topk 4")
    assert [x.split("] ")[1].split(" in ")[0] for x in lines[1:]] == [
        "tuned",
        "built",
        "test_acc FAIL (max err 3.0e-03)",
    ]


@pytest.mark.parametrize("folder", SCRIPTS)
def test_plot_only_without_results_names_the_missing_csv(tmp_path: Path, capsys, folder) -> None:
    """--plot-only where the script has no CSV yet: exit 2 naming the file, nothing written
    (it used to stop with a traceback writing the table into a folder that did not exist)."""
    out = tmp_path / "absent"
    assert script(folder).main(["--plot-only", "--device", "cpu", "--out", str(out)]) == 2
    assert str(out) in capsys.readouterr().err and not out.exists()


def test_paper_state_seeds_the_results_a_run_goes_on_from(tmp_path: Path) -> None:
    """scripts/paper_state.sh in a checkout without .paper-state/: each script's CSV, table
    and .meta.json of the GPU's committed results, nothing else; a second seeding, an
    unknown GPU: exit 2, the state left as it was."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "paper_state.sh", tmp_path / "scripts")
    results = tmp_path / "artifacts" / "results" / "H200"
    results.mkdir(parents=True)
    kept = ["figure9_10.csv", "figure9_10.md", "table4.meta.json"]
    for name in (*kept, "figure9_fp32.png", "tuned_x.json.gz"):
        (results / name).write_text(name)

    def seed(*args: str) -> subprocess.CompletedProcess[str]:
        command = ["bash", str(tmp_path / "scripts" / "paper_state.sh"), *args]
        return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)

    assert seed().returncode == 0
    state = tmp_path / ".paper-state" / "results"
    assert sorted(p.name for p in state.iterdir()) == kept
    assert (state / "figure9_10.csv").read_text() == "figure9_10.csv"
    (state / "figure9_10.csv").write_text("a line not committed yet")
    again = seed()
    assert again.returncode == 2 and "already" in again.stderr
    assert (state / "figure9_10.csv").read_text() == "a line not committed yet"
    unknown = seed("B200")
    assert unknown.returncode == 2 and "H200" in unknown.stderr


FAKE_PENDING = """#!/usr/bin/env bash
echo "start $SCRIPT gpu=$CUDA_VISIBLE_DEVICES limit=$LIMIT $(date +%s.%N)" >> "$OUT/trace"
sleep "$FAKE_SLEEP"
echo "end $SCRIPT gpu=$CUDA_VISIBLE_DEVICES $(date +%s.%N)" >> "$OUT/trace"
"""


def test_side_by_side_runs_the_specs_of_one_gpu_in_turn(tmp_path: Path) -> None:
    """Specs naming the same GPU run on it one after another, each given what is left of
    LIMIT, while another GPU's run beside them; one with under MIN_LEFT seconds left is not
    started, and its GPU's log says so."""
    runner = ROOT / "scripts" / "paper_side_by_side.sh"
    fake = tmp_path / "pending.sh"
    fake.write_text(FAKE_PENDING)
    out = tmp_path / "out"
    env = dict(
        os.environ,
        OUT=str(out),
        PAPER_RESULTS=str(tmp_path),
        PAPER_PENDING=str(fake),
        FAKE_SLEEP="2",
        LIMIT="100",
        MIN_LEFT="99",
        CORES="1",
    )
    specs = [
        "0|Figure13|--models nerf --bs 1",
        "1|Figure10b|--models nerf --bs 1",
        "0|Figure10b|--models nerf --bs 1",
    ]
    proc = subprocess.run(["bash", str(runner), *specs], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    events = [line.split() for line in (out / "trace").read_text().splitlines()]
    at = {(e[0], e[1], e[2]): float(e[-1]) for e in events}
    first, beside = ("Figure13", "gpu=0"), ("Figure10b", "gpu=1")
    assert at[("start", *beside)] < at[("end", *first)], "the other GPU's spec ran beside it"
    # the second spec of GPU 0 found fewer than MIN_LEFT seconds left after the first's 2 s
    assert ("start", "Figure10b", "gpu=0") not in at
    assert "not started" in (out / "log_0.txt").read_text()
    env.update(MIN_LEFT="10")
    (out / "trace").unlink()
    proc = subprocess.run(["bash", str(runner), *specs], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    events = [line.split() for line in (out / "trace").read_text().splitlines()]
    at = {(e[0], e[1], e[2]): float(e[-1]) for e in events}
    limits = {(e[1], e[2]): int(e[3].removeprefix("limit=")) for e in events if e[0] == "start"}
    assert at[("end", *first)] <= at[("start", "Figure10b", "gpu=0")], "GPU 0's specs ran in turn"
    assert 99 <= limits[first] <= 100 and 90 <= limits[("Figure10b", "gpu=0")] <= 98


def test_pending_run_returns_the_tune_logs_of_the_runs_folder_it_is_given(tmp_path: Path) -> None:
    """paper_pending.sh packs the tune logs of RUNS, a folder that may lie outside the
    checkout (where a warm machine keeps the exports between calls), into tuned.tar, and
    the results and cache into paper-state.tgz; ``--runs`` in ARGS, which would send the
    builds elsewhere, is refused."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    log = runs / "welder" / "nerf_b1_fp32" / "tune.log"
    log.parent.mkdir(parents=True)
    log.write_text("group 0: 12.5 us\n")
    env = dict(
        os.environ,
        STATE=str(tmp_path / "state"),
        OUT=str(out),
        RUNS=str(runs),
        SCRIPT="Figure13",
        ARGS="--models nerf --bs 1 --pending",
        LIMIT="60",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    )
    runner = ["bash", str(ROOT / "scripts" / "paper_pending.sh")]
    # --runs in ARGS would build elsewhere than the pack looks: refused before anything is made
    for args in ("--models nerf --runs elsewhere", "--runs=elsewhere --bs 1"):
        refused = subprocess.run(
            runner, capture_output=True, text=True, env={**env, "ARGS": args}, timeout=60
        )
        assert refused.returncode == 2 and "set RUNS instead" in refused.stderr, refused.stderr
        assert not (tmp_path / "state").exists() and not out.exists()
    with open(tmp_path / "log.txt", "w") as stdout:
        proc = subprocess.run(runner, stdout=stdout, stderr=subprocess.STDOUT, env=env)
    assert proc.returncode == 0, (tmp_path / "log.txt").read_text()
    with tarfile.open(out / "tuned.tar") as tar:
        packed = tar.extractfile("tuned/log_welder_nerf_b1_fp32.txt.gz")
        assert packed is not None and gzip.decompress(packed.read()) == log.read_bytes()
    with tarfile.open(out / "paper-state.tgz") as tar:
        assert {"results", "cache"} <= {name.split("/")[0] for name in tar.getnames()}
