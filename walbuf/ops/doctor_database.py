"""doctor's examination of a database buffer: a SQLite file (its owner, integrity, journal) or a PostgreSQL server."""

from __future__ import annotations

import sqlalchemy as sa

from ..buffer import DatabaseBuffer
from ..errors import UntrustedPathError
from ..store.backend import Backend
from ..store.sqlite import SQLiteBackend
from ..store.trust import Owner
from .findings import UNTRUSTED_ADVICE, Finding, contents, file_findings, room_finding


def examine_database(findings: list[Finding], buffer: DatabaseBuffer) -> None:
    backend = buffer.backend
    if isinstance(backend, SQLiteBackend):
        try:
            owner = Owner.of(backend.path, write=False)
            if owner.folder(backend.locks):
                for lock in sorted(backend.locks.iterdir()):
                    owner.entry(lock)
        except UntrustedPathError as exc:
            findings.append(Finding("trust", False, str(exc), UNTRUSTED_ADVICE))
            return
        room_finding(findings, backend.path.parent)
        readable, revision = file_findings(findings, backend.path, owner)
    else:
        readable, revision = True, _server_findings(findings, backend)
    if readable:
        contents(findings, revision, buffer)


def _server_findings(findings: list[Finding], backend: Backend) -> str | None:
    """The server of a PostgreSQL buffer (it checks its own pages); the schema revision."""
    engine = backend.engine("normal", busy_timeout=10, access="read")
    try:
        with engine.connect() as conn:
            version = conn.exec_driver_sql("SHOW server_version").scalar()
            schema = conn.exec_driver_sql("SELECT current_schema()").scalar()
            revision = None
            if sa.inspect(conn).has_table("alembic_version"):
                revision = conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
    except sa.exc.DBAPIError as exc:
        raise backend.error(exc.orig) from exc
    finally:
        engine.dispose()
    findings.append(Finding("server", True, f"PostgreSQL {version}, schema {schema}"))
    return revision
