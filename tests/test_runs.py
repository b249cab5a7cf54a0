"""Run folders: one claim rule for every analysis, one slug, and parts that resume or are measured
again when a file of them was emptied."""

import json

import pandas as pd
import pytest

from nopelens.analyses import runs
from nopelens.analyses.sweep import TABLES, SweepSettings, sweep


def test_a_folder_is_resumed_with_the_same_settings_and_refused_with_others(tmp_path):
    runs.claim(tmp_path / "run", "intervene", {"model": "circuit", "n_boot": 200, "modes": ("a", "b")})
    stamp = json.loads((tmp_path / "run" / "intervene.json").read_text())
    assert stamp["settings"]["modes"] == ["a", "b"] and len(stamp["digest"]) == 12
    runs.claim(tmp_path / "run", "intervene", {"model": "circuit", "n_boot": 200, "modes": ["a", "b"]})
    with pytest.raises(
        ValueError,
        match=r"holds a run of nopelens intervene made with other settings \(n_boot: 200 there, "
        r"11 now\); use another --out folder, or delete it",
    ):
        runs.claim(tmp_path / "run", "intervene", {"model": "circuit", "n_boot": 11, "modes": ["a", "b"]})


def test_a_run_resumed_with_the_same_settings_leaves_its_stamp_as_it_was(tmp_path):
    runs.claim(tmp_path, "sweep", {"seed": 0}, command="probe", run="first")
    before = (tmp_path / "sweep.json").read_bytes()
    runs.claim(tmp_path, "sweep", {"seed": 0}, command="sweep", run="second")  # a resume, or a re-read
    assert (tmp_path / "sweep.json").read_bytes() == before


def test_ignored_settings_may_change_and_are_recorded(tmp_path):
    runs.claim(tmp_path, "sweep", {"seed": 0, "train_seeds": [0]}, ignore=("train_seeds",))
    runs.claim(tmp_path, "sweep", {"seed": 0, "train_seeds": [0, 1]}, ignore=("train_seeds",))
    assert json.loads((tmp_path / "sweep.json").read_text())["settings"]["train_seeds"] == [0, 1]
    with pytest.raises(ValueError, match="seed: 0 there, 1 now"):
        runs.claim(tmp_path, "sweep", {"seed": 1, "train_seeds": [0]}, ignore=("train_seeds",))


def test_a_folder_of_another_analysis_is_refused(tmp_path):
    runs.claim(tmp_path, "sweep", {"seed": 0})
    with pytest.raises(
        ValueError, match="holds a run of nopelens sweep; use another --out folder for this intervene run"
    ):
        runs.claim(tmp_path, "intervene", {"seed": 0})


def test_stamps_of_older_folders_are_honoured(tmp_path):
    (tmp_path / "settings.json").write_text(json.dumps({"steps": 500, "n_layers": 3}))
    runs.claim(tmp_path, "lengthgen", {"steps": 500, "n_layers": 3})
    assert (tmp_path / "lengthgen.json").is_file()
    (tmp_path / "lengthgen.json").unlink()
    with pytest.raises(ValueError, match="steps: 500 there, 60 now"):
        runs.claim(tmp_path, "lengthgen", {"steps": 60, "n_layers": 3})
    (tmp_path / "lengthgen.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a nopelens lengthgen stamp"):
        runs.claim(tmp_path, "lengthgen", {"steps": 500, "n_layers": 3})


def test_slug_is_one_safe_file_name():
    assert runs.slug("text-nope-4l") == "text-nope-4l"
    assert runs.slug("constant-rope+rope+rope+nope") == "constant-rope_rope_rope_nope"
    for spec in (".", "..", "../x", ".hidden", ""):
        assert not runs.slug(spec).startswith("."), spec
        assert "/" not in runs.slug(spec)
    assert runs.part_dir("out", "hf:/m/x", 2).as_posix() == "out/parts/hf__m_x-seed2"


@pytest.mark.slow
def test_an_emptied_or_truncated_table_of_a_finished_part_is_named_and_measured_again(tmp_path, capsys, one_thread):
    """Emptied, cut mid-line (it raised an IndexError in the summary) or cut at a line boundary (it
    was reused, and the summary lost the reads of the missing rows): each is measured again."""
    settings = SweepSettings(models=("circuit",), n_sequences=12, seq_len=16, n_boot=20, n_splits=3)
    out = tmp_path / "run"
    sweep(settings, out, progress=False)
    first = {name: pd.read_csv(out / f"{name}.csv") for name in (*TABLES, "summary")}
    probes = out / "parts" / "circuit" / "probes.csv"
    whole = probes.read_text()
    lines = whole.splitlines(keepends=True)
    for cut in ("", whole[: len(whole) // 2], "".join(lines[: len(lines) // 2])):
        probes.write_text(cut)
        capsys.readouterr()
        sweep(settings, out, progress=False)
        err = capsys.readouterr().err
        assert f"{probes} is not what was written when the part was finished (its sha256 differs" in err, err
        assert "measuring that part again" in err
        assert probes.read_text() == whole
        for name, table in first.items():
            pd.testing.assert_frame_equal(pd.read_csv(out / f"{name}.csv"), table)
    probes.unlink()
    sweep(settings, out, progress=False)
    assert f"{probes} is missing from a finished part; measuring that part again" in capsys.readouterr().err
    assert probes.read_text() == whole
    fresh = {name: (out / f"{name}.csv").read_bytes() for name in (*TABLES, "summary")}
    sweep(settings, out, progress=True)
    assert "already measured" in capsys.readouterr().err
    assert {name: (out / f"{name}.csv").read_bytes() for name in fresh} == fresh, "a resumed run writes the same bytes"


def test_a_folder_in_use_by_another_run_is_refused_and_its_stamp_kept(tmp_path):
    """An interrupted run may wait minutes for its workers; a rerun started meanwhile must not train
    the same models beside it and write its tables over the first's."""
    folder = tmp_path / "run"
    with runs.claimed(folder, "sweep", {"seed": 0, "train_seeds": [0]}, ignore=("train_seeds",), command="probe"):
        stamp = (folder / "sweep.json").read_bytes()
        with pytest.raises(
            ValueError,
            match=r"run is in use by another nopelens run; wait for it to end, .* for this sweep run",
        ):
            with runs.claimed(folder, "sweep", {"seed": 0, "train_seeds": [0, 1]}, ignore=("train_seeds",)):
                pass
        assert (folder / "sweep.json").read_bytes() == stamp  # the running run's stamp is its own
    with runs.claimed(folder, "sweep", {"seed": 0, "train_seeds": [0]}, ignore=("train_seeds",)):
        pass  # released when the run ends


def test_a_run_that_fails_before_writing_leaves_no_stamp_but_finished_parts_keep_theirs(tmp_path):
    """A refused probe left sweep.json behind, which then refused the corrected rerun as "other settings"."""
    with pytest.raises(ValueError, match="refused"):
        with runs.claimed(tmp_path / "new", "sweep", {"seed": 0}, command="probe"):
            raise ValueError("refused")
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("the user's")
    with pytest.raises(KeyboardInterrupt):
        with runs.claimed(tmp_path / "mine", "sweep", {"seed": 0}):
            (tmp_path / "mine" / "parts" / "empty").mkdir(parents=True)
            raise KeyboardInterrupt
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]
    with pytest.raises(ValueError):
        with runs.claimed(tmp_path / "half", "sweep", {"seed": 0}):
            runs.write_part(runs.part_dir(tmp_path / "half", "a"), {}, {"name": "a"})
            raise ValueError("the second model is refused")
    assert (tmp_path / "half" / "sweep.json").is_file()  # the next run resumes from part a
    runs.claim(tmp_path / "old", "sweep", {"seed": 0})
    with pytest.raises(ValueError):
        with runs.claimed(tmp_path / "old", "sweep", {"seed": 0}):
            raise ValueError("refused on a rerun")
    assert (tmp_path / "old" / "sweep.json").is_file()


def test_a_refused_folder_names_the_command_that_made_it_and_reads_unset_settings_in_words(tmp_path):
    runs.claim(tmp_path, "sweep", {"seed": 0, "models": ["a", "b"]}, command="probe")
    with pytest.raises(
        ValueError,
        match=r"holds a run of nopelens probe made with other settings \(hf_input: not set "
        r"\(input random\) there, input text, device cpu now; models: a,b there, c now\)",
    ):
        runs.claim(
            tmp_path,
            "sweep",
            {"seed": 0, "models": ["c"], "hf_input": {"input": "text", "device": "cpu", "dtype": None}},
            command="sweep",
            unset={"hf_input": "input random"},
        )
    with pytest.raises(
        ValueError, match="holds a run of nopelens probe; use another --out folder for this intervene run"
    ):
        runs.claim(tmp_path, "intervene", {"seed": 0})


def test_a_refused_folder_names_each_field_of_a_record_that_differs(tmp_path):
    """A record (``hf_input``) missing on one side is read as its default record, field by field."""
    default = {"input": "random", "text": None, "device": "cpu", "dtype": None}
    runs.claim(tmp_path, "sweep", {"seed": 0, "hf_input": {**default, "input": "text"}}, command="probe")
    for now, change in [
        ({"seed": 0}, "hf_input.input: text there, random now"),
        (
            {"seed": 0, "hf_input": {**default, "dtype": "float32"}},
            "hf_input.dtype: none there, float32 now; hf_input.input: text there, random now",
        ),
    ]:
        with pytest.raises(ValueError, match=rf"made with other settings \({change}\); use another"):
            runs.claim(tmp_path, "sweep", now, command="probe", unset={"hf_input": default})


def test_a_probe_folder_resumes_with_another_batch_size_or_keep_budget(tmp_path):
    """They cut the same work into other forward passes (round-off only); the stamp records the latest."""
    import dataclasses

    from nopelens.analyses.sweep import SweepSettings

    first = dataclasses.replace(SweepSettings.quick(), streamed=True, batch_size=4, keep_mib=0)
    runs.claim(tmp_path, "sweep", first.to_dict(), ignore=first.RESUMABLE_CHANGES, command="probe")
    again = dataclasses.replace(first, batch_size="auto", keep_mib=None)
    assert again.digest() == first.digest()
    runs.claim(tmp_path, "sweep", again.to_dict(), ignore=again.RESUMABLE_CHANGES, command="probe")
    assert "batch_size" not in runs.read_json(tmp_path / "sweep.json")["settings"]
    other = dataclasses.replace(first, n_boot=first.n_boot + 1)
    with pytest.raises(ValueError, match="other settings"):
        runs.claim(tmp_path, "sweep", other.to_dict(), ignore=other.RESUMABLE_CHANGES, command="probe")


@pytest.mark.slow
def test_a_part_measured_with_other_settings_is_refused_even_without_the_stamp(tmp_path, capsys, one_thread):
    """done.json records the settings' digest: a folder whose stamp was lost (deleted, or removed by a
    run interrupted while another used the folder) does not reuse parts measured otherwise."""
    from nopelens.analyses.cli import main

    out = str(tmp_path / "run")
    assert main(["probe", "untrained-nope", "--quick", "--no-figures", "--quiet", "--out", out]) == 0
    (tmp_path / "run" / "sweep.json").unlink()
    capsys.readouterr()
    assert (
        main(
            [
                "probe",
                "untrained-nope",
                "--quick",
                "--no-figures",
                "--quiet",
                "--out",
                out,
                "--seq-len",
                "16",
                "--n-sequences",
                "12",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "parts/untrained-nope was measured with other settings than this run's" in err and "Traceback" not in err
    assert main(["probe", "untrained-nope", "--quick", "--no-figures", "--quiet", "--out", out]) == 0


def test_an_interrupted_run_leaves_a_stamp_another_run_claimed_since(tmp_path):
    settings = {"seed": 0, "train_seeds": [0]}
    with pytest.raises(KeyboardInterrupt):
        with runs.claimed(tmp_path / "run", "sweep", settings, ignore=("train_seeds",)):
            # a second run, meanwhile, with more training seeds (a run with the very same settings is held off)
            runs.claim(tmp_path / "run", "sweep", {"seed": 0, "train_seeds": [0, 1]}, ignore=("train_seeds",))
            raise KeyboardInterrupt
    assert (tmp_path / "run" / "sweep.json").is_file()
    with pytest.raises(KeyboardInterrupt):  # alone, the interrupted run removes what it made
        with runs.claimed(tmp_path / "fresh", "sweep", settings):
            raise KeyboardInterrupt
    assert not (tmp_path / "fresh").exists()


def test_models_the_tables_would_name_alike_or_that_share_a_part_folder_are_refused_before_any_work():
    from nopelens.analyses.sweep import _check_distinct

    _check_distinct([("hf:/a/m", 0), ("hf:/b/n", 0), ("text-nope-4l", 0), ("text-nope-4l", 1)])
    with pytest.raises(ValueError, match="hf:/a/m and hf:/b/m would both be named hf:m; give each model once"):
        _check_distinct([("hf:/a/m", 0), ("hf:/b/m", 0)])
    with pytest.raises(ValueError, match="hf:m a and hf:m_a would share the part folder hf_m_a"):
        _check_distinct([("hf:m a", 0), ("hf:m_a", 0)])


def test_a_scheduler_gets_absolute_paths_only(tmp_path):
    import dataclasses

    from nopelens.analyses.subjects import HFInput
    from nopelens.analyses.sweep import _check_absolute_paths

    settings = SweepSettings(models=(f"hf:{tmp_path}", "text-nope-4l"))
    _check_absolute_paths(settings)
    with pytest.raises(ValueError, match="--scheduler: models/m is a relative path, which each Dask worker would read"):
        _check_absolute_paths(dataclasses.replace(settings, models=("hf:models/m",)))
    with pytest.raises(ValueError, match="--scheduler: my.txt is a relative path"):
        _check_absolute_paths(dataclasses.replace(settings, hf_input=HFInput(input="text", text="my.txt")))


def test_unreadable_stamps_and_part_records_are_named(tmp_path, capsys):
    from nopelens.models.io import read_json

    (tmp_path / "sweep.json").write_bytes(bytes(range(128, 256)))
    with pytest.raises(ValueError, match="sweep.json is not valid JSON"):
        read_json(tmp_path / "sweep.json")
    part = tmp_path / "parts" / "m"
    part.mkdir(parents=True)
    pd.DataFrame({"a": [1]}).to_csv(part / "probes.csv", index=False)
    (part / "done.json").write_text(json.dumps({"table_sha256": 5}))
    assert runs.read_part(part, ["probes"]) is None
    assert "its table_sha256 is not a record of checksums" in capsys.readouterr().err


@pytest.mark.slow
def test_sigterm_ends_a_run_as_an_interrupt_does(tmp_path):
    """``kill`` or ``timeout``: one line, exit 130, and a run stopped before its first part leaves no
    stamp (its corrected rerun is not refused)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nopelens",
            "probe",
            "untrained-nope",
            "--quick",
            "--quiet",
            "--no-figures",
            "--n-sequences",
            "400",
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + 120
    while not (out / "sweep.json").is_file() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    assert not (out / "parts").exists() and not (out / "sweep.json").exists()


def test_sigterm_while_the_cli_imports_lands_after_the_imports():
    """A SIGTERM held back while modules import is delivered, as KeyboardInterrupt, when they are
    done: not inside an import's ``__del__``, where Python prints it as "Exception ignored" and
    drops it."""
    import signal
    import threading

    from nopelens.analyses import cli

    previous = cli._terminate_as_interrupt()
    reached = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with cli._sigterm_held():
                signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
                reached.append("after the signal")
        assert reached == ["after the signal"]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sinks_writes_into_no_other_commands_run_folder(tmp_path, capsys):
    from nopelens.analyses.cli import main

    runs.claim(tmp_path / "run", "intervene", {"seed": 0})
    assert main(["sinks", "circuit", "--quick", "--quiet", "--out", str(tmp_path / "run")]) == 2
    assert "holds a run of nopelens intervene; use another --out folder for this sinks run" in capsys.readouterr().err
    assert not (tmp_path / "run" / "sinks.csv").exists()
    assert main(["sinks", "circuit", "--quick", "--quiet", "--out", " "]) == 2
    assert "--out is empty" in capsys.readouterr().err


def test_a_folder_holding_someone_elses_files_is_refused_not_overwritten(tmp_path):
    (tmp_path / "summary.md").write_text("my notes")
    with pytest.raises(
        ValueError,
        match=r"holds tables or figures no nopelens probe run wrote \(summary.md\), which it could "
        "overwrite; use a new or empty --out folder",
    ):
        runs.claim(tmp_path, "sweep", {"seed": 0}, command="probe")
    assert (tmp_path / "summary.md").read_text() == "my notes" and not (tmp_path / "sweep.json").exists()
    (tmp_path / "parts").mkdir()  # a run whose stamp was lost: resumed, its parts checked one by one
    runs.claim(tmp_path, "sweep", {"seed": 0})
    runs.claim(tmp_path, "sweep", {"seed": 0})  # stamped now
