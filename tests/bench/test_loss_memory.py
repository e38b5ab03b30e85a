"""`bench --losses`: the memory of the losses' forward + backward, measured from the command (the
figures of docs/objectives.md and docs/losses.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miniverl.bench.loss_memory import FAMILIES, KEEPS

from conftest import ROOT


@pytest.mark.slow
def test_the_losses_bench_writes_both_tables_and_selection_saves_memory_in_every_family(tmp_path):
    out = tmp_path / "losses"
    command = [sys.executable, "-m", "miniverl.bench", "--losses", "--vocab", "1024", "--out", str(out)]
    done = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "losses.json").read_text())
    assert result["command"] == "python -m miniverl.bench --losses --vocab 1024 --out " + str(out)
    peaks = result["selection"]["peaks"]
    assert set(peaks) == set(FAMILIES)
    for name, rows in peaks.items():
        assert set(rows) == {str(k) for k in KEEPS}
        assert rows["1.0"]["selection"] == 0  # no selection pass without a selection
        # fewer positions through the head with gradients: less memory, in every family
        assert rows["0.25"]["loss"] < rows["0.5"]["loss"] < rows["1.0"]["loss"], (name, rows)
        assert rows["0.25"]["selection"] > 0 and rows["0.25"]["whole"] >= rows["0.25"]["selection"], (name, rows)
    topk = result["chunked_topk"]["peaks"]
    assert topk["chunked"] < topk["unchunked"], topk
    table = (out / "losses.md").read_text()
    assert "| `reverse_kl_full` |" in table and "Chunked top-k" in table
    assert table in done.stdout  # printed as well
    assert "USDT" not in done.stderr and "profiler_start" not in done.stderr  # ~100 lines of torch's profiler


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--losses", "--quality", "--student", "a", "--teacher", "b"], "--losses measures the losses on small random"),
        (["--losses", "--device", "cuda"], "--losses measures the losses on small random models on the CPU"),
        (["--losses", "--vocab", "8"], "--vocab 8: give at least 16"),
        (["--vocab", "1024"], "--vocab sizes the models of --losses only"),
    ],
)
def test_the_losses_bench_refuses_what_it_does_not_measure_in_one_line(argv, said, capsys):
    from miniverl.bench.cli import parse_args

    with pytest.raises(SystemExit) as error:
        parse_args(argv)
    assert error.value.code == 2 and said in capsys.readouterr().err


def test_a_bench_never_replaces_an_earlier_result_and_by_default_writes_a_new_folder(tmp_path, monkeypatch, capsys):
    """A new-user audit ran `bench --losses --out DIR` twice: the second replaced the first's losses.json, and
    the default --out was one fixed folder per kind."""
    from miniverl.bench.cli import main
    from miniverl.bench.tables import result_folder

    out = tmp_path / "losses"
    out.mkdir()
    (out / "losses.json").write_text("{}\n")  # an earlier measurement
    assert main(["--losses", "--vocab", "16", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"miniverl.bench: error: --out {out} holds an earlier bench's losses.json: give another --out (or leave it "
        "out: a new folder under outputs/bench/losses/), or remove that one"
    )
    assert (out / "losses.json").read_text() == "{}\n"
    for file in (out / "losses.json", out / "losses.json" / "sub"):  # a traceback (FileExistsError) before
        assert main(["--losses", "--vocab", "16", "--out", str(file)]) == 2
        assert (
            capsys.readouterr()
            .err.strip()
            .endswith(f"{out / 'losses.json'} is a file, not a folder; choose another --out")
        )
    run = tmp_path / "run"  # a config audit: a training run's folder was taken as --out (the bench wrote in it)
    (run / "checkpoints" / "update_1").mkdir(parents=True)
    (run / "report.json").write_text("{}\n")
    assert main(["--losses", "--vocab", "16", "--out", str(run)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"miniverl.bench: error: --out {run} holds a training run's files, which the bench never writes beside: "
        "choose another --out"
    )
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "report.json"]
    monkeypatch.chdir(tmp_path)
    with result_folder(None, "toy", "bench.json") as first:
        assert first.parts[:3] == ("outputs", "bench", "toy") and len(first.parts) == 5  # <date>/<time>
        with result_folder(None, "toy", "bench.json") as second:
            assert second != first and second.is_dir()


def test_an_out_folder_that_cannot_be_made_is_one_line(capsys):
    """`bench --losses --out /proc/x` ended in mkdir's FileNotFoundError traceback (no folder can be made in
    /proc, even by root)."""
    from miniverl.bench.cli import main

    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc on this system")
    assert main(["--losses", "--vocab", "16", "--out", "/proc/x/bench"]) == 2
    assert capsys.readouterr().err.strip() == (
        "miniverl.bench: error: cannot write /proc/x: No such file or directory; choose another --out"
    )


def test_a_bench_refused_before_it_wrote_anything_leaves_no_folder_behind(tmp_path, monkeypatch, capsys):
    """A new-user audit's bench with a --student that is no model left its empty --out folder."""
    from miniverl.bench.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "kept").mkdir()  # a folder the user made: it stays
    not_models = ["--student", str(tmp_path / "no_student"), "--teacher", str(tmp_path / "no_teacher")]
    for out in ([], ["--out", "kept/new/bench"], ["--out", "kept"]):
        assert main([*not_models, *out]) == 2
        assert "no_student" in capsys.readouterr().err
        assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["kept"]
