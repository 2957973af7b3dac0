"""`splitkv-gen --tune`'s bad flags: each one line naming the flag and what it expects, exit 2,
before Optuna is imported, a program compiled, a GPU touched or a file written (CPU only)."""

from __future__ import annotations

import json

import pytest

from splitkv import cli
from splitkv.autotune import flags


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test when the run gets past its flags: Optuna imported, a GPU asked for, a
    program compiled."""
    import splitkv.autotune.cli as tune_cli
    import splitkv.autotune.studies as studies
    import splitkv.codegen.compile as compile_module

    def started(*_args, **_kwargs):
        raise AssertionError("the run started work before its flags were checked")
    monkeypatch.setattr(studies, "import_optuna", started)
    monkeypatch.setattr(tune_cli, "_check_gpu", started)
    monkeypatch.setattr(compile_module, "compile_cubin", started)


def _refused(capsys, tmp_path, *argv) -> str:
    """The one error line of a tuning run with ``argv`` that must be refused with status 2, and
    nothing written under ``tmp_path`` (besides what the test made there first)."""
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as raised:
        cli.main(["--arch", "sm90", "--tune", "--cost-model", "--head-dim", "128", "--group", "4", "--dtype", "bf16",
                  *argv])
    assert raised.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("splitkv-gen: error")]
    assert len(errors) == 1
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    return errors[0]


@pytest.mark.parametrize("argv, expected", [
    (["--timeout", "0"], "--timeout: expected a positive number of seconds, got 0.0"),
    (["--timeout", "-5"], "--timeout: expected a positive number of seconds, got -5.0"),
    (["--timeout", "nan"], "--timeout: expected a positive number of seconds, got nan"),
    (["--timeout", "inf"], "--timeout: expected a positive number of seconds, got inf"),
    (["--iters", "0"], "--iters: expected a positive number of timed calls, got 0"),
    (["--iters", "-3"], "--iters: expected a positive number of timed calls, got -3"),
    (["--bucket", ","], "--bucket: expected bucket names such as b1-l32k, got ','"),
    (["--bucket", ""], "--bucket: expected bucket names such as b1-l32k, got ''"),
    (["--bucket", "b1-l32k", "--bucket", " , "], "got ' , '"),
    (["--bucket", "b70000-l1k"], "--bucket: b70000-l1k has a batch of 70000; at most 65535"),
    (["--bucket", "b1-l4096m"], "has sequences of 4294967296 tokens"),
    (["--bucket", "b4096-l1m"], "--bucket: b4096-l1m needs 16384 GiB of K/V inputs"),
    (["--bucket", "b0-l1k"], "batch must be a positive int"),
    (["--emit", ""], "--emit: expected a path, got ''"),
    (["--report", ""], "--report: expected a path, got ''"),
    (["--out", " "], "--out: expected a path, got ' '"),
    (["--storage", ""], "--storage: expected sqlite:///FILE"),
    (["--storage", "tune.db"], "--storage: expected sqlite:///FILE"),
    (["--storage", "redis://localhost/0"], "--storage: unknown scheme 'redis'"),
    (["--storage", "postgresql+nodriver://u@h/db"], "needs the driver nodriver, which is not installed here"),
])
def test_a_bad_flag_is_one_line_and_exit_2_before_any_work(capsys, tmp_path, no_work, argv, expected):
    assert expected in _refused(capsys, tmp_path, *argv)


def test_postgresql_without_its_driver_says_which_to_install(capsys, tmp_path, no_work, monkeypatch):
    real_find_spec = flags.importlib.util.find_spec
    monkeypatch.setattr(flags.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("psycopg", "psycopg2") else real_find_spec(name, *a))
    # A plain URL: the driver the installed SQLAlchemy takes (psycopg 3 from SQLAlchemy 2.1 on).
    line = _refused(capsys, tmp_path, "--storage", "postgresql://tuner@db.example/tables")
    default = flags._default_driver("postgresql")
    assert default in ("psycopg", "psycopg2")
    assert f"driver {default}, which is not installed here" in line and "pip install" in line
    line = _refused(capsys, tmp_path, "--storage", "postgresql+psycopg2://tuner@db.example/tables")
    assert "driver psycopg2" in line and "pip install psycopg2-binary" in line


def test_sqlite_in_a_missing_folder_or_onto_a_folder(capsys, tmp_path, no_work):
    line = _refused(capsys, tmp_path, "--storage", f"sqlite:///{tmp_path}/missing/tune.db")
    assert "does not exist (SQLite does not create it)" in line
    (tmp_path / "adir").mkdir()
    assert "is not an SQLite file" in _refused(capsys, tmp_path, "--storage", f"sqlite:///{tmp_path}/adir")


def test_read_only_folders_are_refused(capsys, tmp_path, no_work, monkeypatch):
    # Root may write anywhere, so the read-only folder is the one the check is told is read-only.
    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.setattr(flags, "_writable", lambda path: locked not in (path, *path.parents))
    assert "cannot write the SQLite file" in _refused(capsys, tmp_path, "--storage", f"sqlite:///{locked}/tune.db")
    assert f"cannot write to {locked} (read-only), to create" in _refused(
        capsys, tmp_path, "--storage", str(locked / "runs" / "tune.log"))
    assert f"--report: cannot write to {locked} (read-only)" in _refused(capsys, tmp_path, "--report", str(locked))


def test_report_onto_a_file_or_under_one(capsys, tmp_path, no_work):
    existing = tmp_path / "summary.md"
    existing.write_text("an earlier report")
    assert "exists and is not a folder" in _refused(capsys, tmp_path, "--report", str(existing))
    assert f"cannot create {existing / 'sub'}: {existing} is not a folder" in _refused(
        capsys, tmp_path, "--report", str(existing / "sub"))
    assert existing.read_text() == "an earlier report"


def test_an_existing_file_that_is_not_a_journal_is_left_alone(capsys, tmp_path, no_work):
    notes = tmp_path / "notes.log"
    notes.write_text("2026-12-01 12:00 the run started\n")
    line = _refused(capsys, tmp_path, "--storage", str(notes))
    assert "is not an Optuna journal" in line
    assert notes.read_text() == "2026-12-01 12:00 the run started\n"  # not appended to
    (tmp_path / "dir.journal").mkdir()
    assert "exists and is not a file" in _refused(capsys, tmp_path, "--storage", str(tmp_path / "dir.journal"))


def test_good_storages_pass_the_checks(tmp_path):
    class Parser:
        def error(self, message):
            raise AssertionError(message)

    journal = tmp_path / "old.log"
    journal.write_text(json.dumps({"op_code": 0, "worker_id": "w", "study_name": "s"}) + "\n")
    (tmp_path / "empty.log").write_text("")
    for storage in (str(journal), str(tmp_path / "empty.log"), str(tmp_path / "new" / "deeper" / "t.journal"),
                    f"journal:{tmp_path}/j", f"sqlite:///{tmp_path}/tune.db", "sqlite:///:memory:",
                    "sqlite://", None):
        flags.check_storage(Parser(), storage)
    flags.check_report(Parser(), tmp_path / "report" / "new")
    flags.check_report(Parser(), None)
    assert not (tmp_path / "new").exists() and not (tmp_path / "report").exists()  # checked, not created


def test_a_usable_run_gets_past_its_flags(capsys, tmp_path, monkeypatch):
    """The same command with good flags reaches the work the bad ones stop before."""
    import splitkv.autotune.studies as studies

    reached = []

    def import_optuna():
        reached.append(True)
        raise ImportError("stop here")
    monkeypatch.setattr(studies, "import_optuna", import_optuna)
    rc = cli.main(["--arch", "sm90", "--tune", "--cost-model", "--head-dim", "128", "--group", "4", "--dtype", "bf16",
                   "--timeout", "30", "--iters", "5", "--bucket", "b1-l2k,b4-l8k", "--storage", str(tmp_path / "t.log"),
                   "--report", str(tmp_path / "report")])
    assert reached and rc == 2 and "stop here" in capsys.readouterr().err


def test_a_database_that_does_not_answer_is_one_line(capsys, tmp_path):
    pytest.importorskip("optuna")
    pytest.importorskip("psycopg")
    # Nothing listens on port 1 of this machine: the connection is refused at once.
    rc = cli.main(["--arch", "sm90", "--tune", "--cost-model", "--head-dim", "128", "--group", "4", "--dtype", "bf16",
                   "--bucket", "b1-l1k", "--out", str(tmp_path / "tables"),
                   "--storage", "postgresql+psycopg://tuner:secret@127.0.0.1:1/tables"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("splitkv-gen: --storage: cannot open postgresql+psycopg://tuner:***@127.0.0.1:1/tables: ")
    assert "secret" not in "\n".join(err)
    assert not (tmp_path / "tables").exists()
