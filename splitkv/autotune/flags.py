"""The tuner's command line checked before any work: each bad value is one line naming its flag
and what it expects (`parser.error`: exit 2), found before Optuna is imported, a program compiled,
a GPU touched or a file written. What can only be known by trying (a PostgreSQL server that does
not answer) is still said when the run meets it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
from pathlib import Path

from ..choices import kv_token_bytes
from ..tuned.keys import MAX_BATCH as MAX_BUCKET_BATCH  # a launch grid's z extent
from ..tuned.keys import MAX_SEQ_LEN as MAX_BUCKET_LEN  # lengths are int32 on the device
from ..tuned.keys import REFERENCE_KV_HEADS
from .studies import journal_path

#: The K/V bytes of one bucket's inputs that a tuning run may allocate on one GPU (the largest key
#: of the run): far past any bucket worth tuning, well inside an H200's memory.
MAX_BUCKET_KV_BYTES = 64 << 30
#: The drivers SQLAlchemy picks for a dialect without a '+driver' when it cannot be asked (2.0's;
#: 2.1 takes psycopg 3 for postgresql: `_default_driver` asks the installed SQLAlchemy), and the
#: modules drivers import as.
_DEFAULT_DRIVERS = {"postgresql": "psycopg2", "mysql": "mysqldb"}
_DRIVER_MODULES = {"mysqldb": "MySQLdb", "pymysql": "pymysql", "psycopg2": "psycopg2", "psycopg": "psycopg",
                   "pg8000": "pg8000", "mysqlconnector": "mysql.connector"}
_DRIVER_PACKAGES = {"psycopg2": "psycopg2-binary", "psycopg": "'psycopg[binary]' (or splitkv[tune-pg])",
                    "mysqldb": "mysqlclient", "mysqlconnector": "mysql-connector-python"}
_STORAGE_FORMS = ("sqlite:///FILE, postgresql://USER:PASSWORD@HOST/DB, mysql://... or a journal file "
                  "(*.log, *.journal or journal:PATH)")
#: How much of an existing journal is read to recognise it.
_JOURNAL_PROBE_BYTES = 1 << 20


def path_arg(text: str) -> Path:
    """An argparse type for a path flag: '' (which Path reads as the current folder) is refused."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r}")
    return Path(text)


def check(args, parser, keys, buckets) -> None:
    """Every check below, in the order of the flags' help."""
    if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
        parser.error(f"--timeout: expected a positive number of seconds, got {args.timeout}")
    if args.iters < 1:
        parser.error(f"--iters: expected a positive number of timed calls, got {args.iters}")
    check_bucket_sizes(parser, buckets, keys)
    check_report(parser, args.report)
    check_storage(parser, args.storage)


def bucket_names(parser, groups) -> list[str] | None:
    """The names of the --bucket values (each a comma-separated list); None when none was given.
    A value that names no bucket (',' or '') is an error, not the default set."""
    if not groups:
        return None
    names = []
    for group in groups:
        found = [name.strip() for name in group.split(",") if name.strip()]
        if not found:
            parser.error(f"--bucket: expected bucket names such as b1-l32k, got {group!r}")
        names += found
    return names


def check_bucket_sizes(parser, buckets, keys) -> None:
    """Buckets a GPU can hold: a batch the launch grid takes, int32 lengths, and K/V inputs within
    `MAX_BUCKET_KV_BYTES` for the run's largest key."""
    token_bytes = max((2 * REFERENCE_KV_HEADS * kv_token_bytes(k.head_dim, k.kv_dtype) for k in keys), default=0)
    for bucket in buckets:
        if bucket.batch > MAX_BUCKET_BATCH:
            parser.error(f"--bucket: {bucket.name} has a batch of {bucket.batch}; at most {MAX_BUCKET_BATCH}")
        if bucket.seq_len > MAX_BUCKET_LEN:
            parser.error(f"--bucket: {bucket.name} has sequences of {bucket.seq_len} tokens; at most {MAX_BUCKET_LEN}")
        kv_bytes = bucket.batch * bucket.seq_len * token_bytes
        if kv_bytes > MAX_BUCKET_KV_BYTES:
            parser.error(f"--bucket: {bucket.name} needs {kv_bytes / 2**30:.0f} GiB of K/V inputs for this run's "
                         f"largest key; at most {MAX_BUCKET_KV_BYTES >> 30} GiB")


def check_report(parser, report: Path | None) -> None:
    """--report DIR: a folder that exists and can be written, or one that can be created."""
    if report is None:
        return
    if report.exists() and not report.is_dir():
        parser.error(f"--report: {report} exists and is not a folder; expected a folder to write the report into")
    problem = _unwritable_folder(report)
    if problem:
        parser.error(f"--report: {problem}")


def check_storage(parser, storage: str | None) -> None:
    """--storage: a journal file that is one (or a new one in a folder that can be written), or an
    RDB URL of a known dialect whose driver is installed (an SQLite file in a folder that exists
    and can be written)."""
    if storage is None:
        return
    if not storage.strip():
        parser.error(f"--storage: expected {_STORAGE_FORMS}, got {storage!r}")
    journal = journal_path(storage)
    if journal is not None:
        problem = _journal_problem(journal)
        if problem:
            parser.error(f"--storage: {problem}")
        return
    scheme, sep, rest = storage.partition("://")
    if not sep:
        parser.error(f"--storage: expected {_STORAGE_FORMS}, got {storage!r}")
    dialect, _, driver = scheme.lower().partition("+")
    if dialect == "sqlite":
        problem = _sqlite_problem(rest)
    elif dialect in _DEFAULT_DRIVERS:
        problem = _driver_problem(dialect, driver or _default_driver(dialect))
    else:
        problem = f"unknown scheme {scheme!r}; expected {_STORAGE_FORMS}"
    if problem:
        parser.error(f"--storage: {problem}")


def _journal_problem(path: Path) -> str | None:
    if path.exists():
        if not path.is_file():
            return f"{path} exists and is not a file"
        try:
            with open(path, "rb") as f:
                first = f.readline(_JOURNAL_PROBE_BYTES)
        except OSError as e:
            return f"cannot read {path}: {e.strerror or e}"
        if first.strip() and not _is_journal_record(first):
            return (f"{path} exists and is not an Optuna journal (its first line is not a journal record); "
                    f"give a new file, or the journal of an earlier run to resume it")
        if not _writable(path):
            return f"cannot write to {path}"
        return None
    return _unwritable_folder(path.parent)


def _is_journal_record(line: bytes) -> bool:
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return isinstance(record, dict) and "op_code" in record


def _sqlite_problem(rest: str) -> str | None:
    """sqlite:///FILE (rest: '/FILE'): its folder exists and can be written (SQLite creates the
    file and its journal there, not the folder); ':memory:' and '' are in-memory databases."""
    name = rest[1:] if rest.startswith("/") else rest
    if name in ("", ":memory:"):
        return None
    path = Path(name)
    if path.exists() and not path.is_file():
        return f"{path} exists and is not an SQLite file"
    folder = path.parent
    if not folder.is_dir():
        return f"the folder of the SQLite file {path} does not exist (SQLite does not create it)"
    if not _writable(folder) or (path.exists() and not _writable(path)):
        return f"cannot write the SQLite file {path} (its folder or the file is read-only)"
    return None


def _default_driver(dialect: str) -> str:
    """The driver the installed SQLAlchemy connects a plain ``dialect://`` URL with."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(f"{dialect}://").get_dialect().driver
    except Exception:  # noqa: BLE001 - no SQLAlchemy (then Optuna is missing too, said later), or a dialect it lacks
        return _DEFAULT_DRIVERS[dialect]


def _driver_problem(dialect: str, driver: str) -> str | None:
    module = _DRIVER_MODULES.get(driver, driver)
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    package = _DRIVER_PACKAGES.get(driver, driver)
    return (f"a {dialect} URL needs the driver {driver}, which is not installed here "
            f"(pip install {package}, or name another with {dialect}+DRIVER://...)")


def _unwritable_folder(folder: Path) -> str | None:
    """Why ``folder`` cannot be written (or created: its nearest existing parent decides), or None."""
    existing = folder
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot create {folder}: {existing} is not a folder"
    if not _writable(existing):
        return f"cannot write to {existing} (read-only)" + ("" if existing == folder else f", to create {folder}")
    return None


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK | (os.X_OK if path.is_dir() else 0))
