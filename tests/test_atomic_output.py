"""Output that cannot be torn (kvlab.fileio): temp file + fsync + rename, and writability checked before a run."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from kvlab import fileio
from kvlab.cli import app
from kvlab.errors import OutputError

from .conftest import cli_error


def leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_write_json_replaces_the_file_and_keeps_the_mode(tmp_path):
    target = tmp_path / "r.json"
    fileio.write_json(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}
    os.chmod(target, 0o640)
    fileio.write_json(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert target.stat().st_mode & 0o777 == 0o640
    assert leftovers(tmp_path) == []


def test_a_failure_mid_write_leaves_the_old_file_intact(tmp_path):
    target = tmp_path / "report.md"
    target.write_text("the complete old report\n")
    with pytest.raises(RuntimeError):
        with fileio.atomic_path(target) as tmp:
            tmp.write_text("half of a new rep")
            raise RuntimeError("killed mid-write")
    assert target.read_text() == "the complete old report\n"
    assert leftovers(tmp_path) == []


def test_an_interrupt_mid_savefig_leaves_the_old_plot_intact(tmp_path, monkeypatch):
    from kvlab.measure import pyplot

    plt = pyplot()
    target = tmp_path / "counts.png"
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    fileio.save_figure(fig, target)
    complete = target.read_bytes()
    assert complete.startswith(b"\x89PNG") and len(complete) > 1000

    real_savefig = fig.savefig

    def torn_savefig(path, **kwargs):  # writes 124 bytes, then the user presses Ctrl-C
        with open(path, "wb") as fh:
            fh.write(complete[:124])
        raise KeyboardInterrupt

    monkeypatch.setattr(fig, "savefig", torn_savefig)
    with pytest.raises(KeyboardInterrupt):
        fileio.save_figure(fig, target)
    assert target.read_bytes() == complete
    assert leftovers(tmp_path) == []
    monkeypatch.setattr(fig, "savefig", real_savefig)
    fileio.save_figure(fig, tmp_path / "again.svg")
    assert (tmp_path / "again.svg").read_text().lstrip().startswith("<?xml")  # format from the name, not the temp file
    plt.close(fig)


def test_check_writable_makes_missing_folders_and_refuses_impossible_ones(tmp_path):
    assert fileio.check_writable(tmp_path / "new" / "deeper" / "out.json", "--out").parent.is_dir()
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(OutputError, match="--out"):
        fileio.check_writable(blocker / "sub" / "out.json", "--out")
    with pytest.raises(OutputError, match="is a folder"):
        fileio.check_writable(tmp_path, "--out")
    with pytest.raises(OutputError, match="--plot needs a .png, .svg or .pdf"):
        fileio.check_writable(tmp_path / "p.txt", "--plot", fileio.PLOT_SUFFIXES)
    with pytest.raises(OutputError, match="is a file, not a folder"):
        fileio.check_writable_folder(blocker, "--out")


def test_eval_out_into_an_impossible_place_fails_before_the_run(tmp_path, monkeypatch):
    import kvlab.eval.run as eval_run

    def must_not_run(*args, **kwargs):
        raise AssertionError("the evaluation ran before the output location was checked")

    monkeypatch.setattr(eval_run, "run_eval", must_not_run)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = cli_error(["eval", "--quick", "--caches", "int8", "--out", str(blocker / "r.json")])
    assert "--out" in line and "is a file" in line
    if os.path.isdir("/proc/self"):  # a place nobody, not even root, can make a folder in
        line = cli_error(["eval", "--quick", "--caches", "int8", "--out", "/proc/kvlab-nowhere/r.json"])
        assert "--out" in line and "cannot write there" in line
    line = cli_error(["eval", "--quick", "--caches", "int8", "--plot", str(blocker / "q.png")])
    assert "--plot" in line


def test_plan_plot_into_a_missing_folder_is_made(tmp_path):
    target = tmp_path / "missing" / "plan.png"
    result = CliRunner().invoke(app, ["plan", "smollm2-135m", "--plot", str(target)])
    assert result.exit_code == 0, result.output
    assert target.read_bytes().startswith(b"\x89PNG")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = cli_error(["plan", "smollm2-135m", "--plot", str(blocker / "plan.png")])
    assert "--plot" in line and "Traceback" not in line


def test_lab_plot_and_out_are_checked_before_the_experiment(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert "--plot" in cli_error(["lab", "invariance", "--plot", str(blocker / "inv.png")])
    assert "--out" in cli_error(["lab", "all", "--quick", "--out", str(blocker)])
    assert "--out" in cli_error(["bench", "decode", "--out", str(blocker / "d.json"), "--contenders", "kvlab:dense"])
    assert "--weights-dir" in cli_error(["lab", "gqa", "--quick", "--retrain", "--weights-dir", str(blocker / "w")])
