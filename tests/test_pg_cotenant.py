"""PostgreSQL co-tenants: another role of the same database never runs code as the buffer's owner, nor silently keeps
the owner's syncs out.

The owner and the co-tenant are two roles without superuser rights (a
superuser may do anything, and walbuf trusts it), in a database of the
owner's whose ``public`` schema lets every role create objects in it, as
PostgreSQL 14 and older make it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import psycopg
import pytest
import sqlalchemy as sa
from conftest import POSTGRES, require_postgres

import walbuf

pytestmark = pytest.mark.slow


def as_admin(database, statement):
    """Run ``statement`` in ``database`` as the suite's superuser."""
    admin = sa.create_engine(
        sa.make_url(POSTGRES).set(database=database), isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool
    )
    with admin.connect() as conn:
        conn.exec_driver_sql(statement)
    admin.dispose()


@pytest.fixture
def roles():
    """(the owner's buffer URL, the co-tenant's psycopg URL): two roles in a database of the owner's."""
    require_postgres()
    assert POSTGRES is not None
    tag = uuid.uuid4().hex[:10]
    owner, cotenant, database = f"owner_{tag}", f"cotenant_{tag}", f"db_{tag}"
    admin = sa.create_engine(POSTGRES, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {owner} LOGIN")
        conn.exec_driver_sql(f"CREATE ROLE {cotenant} LOGIN")
        conn.exec_driver_sql(f"CREATE DATABASE {database} OWNER {owner}")
    base = sa.make_url(POSTGRES)
    as_admin(database, "GRANT CREATE ON SCHEMA public TO PUBLIC")  # PostgreSQL <= 14's default
    try:
        yield (
            base.set(username=owner, database=database).render_as_string(hide_password=False),
            base.set(drivername="postgresql", username=cotenant, database=database).render_as_string(
                hide_password=False
            ),
            database,
        )
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE {database} WITH (FORCE)")
            conn.exec_driver_sql(f"DROP ROLE {cotenant}")
            conn.exec_driver_sql(f"DROP ROLE {owner}")
        admin.dispose()


STEAL = """
CREATE TABLE public.stolen (n int);
GRANT INSERT ON public.stolen TO PUBLIC;
CREATE FUNCTION public.steal(text, name) RETURNS text LANGUAGE sql
    AS 'INSERT INTO public.stolen VALUES (1); SELECT $1 || $2::text';
CREATE OPERATOR public.|| (LEFTARG = text, RIGHTARG = name, FUNCTION = public.steal);
"""


def test_a_schema_other_roles_may_create_in_is_refused_before_their_code_can_run(roles):
    buffer, cotenant, _ = roles
    with psycopg.connect(cotenant, autocommit=True) as conn:
        conn.execute(STEAL)
    with pytest.raises(walbuf.UntrustedPathError, match="schema 'public' lets PUBLIC create objects in it"):
        walbuf.Writer(buffer, writer="w", run="exp").log({"loss": 0.5})
    with psycopg.connect(cotenant, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM public.stolen").fetchone() == (0,)  # never called


def test_a_schema_only_the_owner_may_create_in_is_used(roles):
    buffer, _, database = roles
    as_admin(database, "REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    with walbuf.Writer(buffer, writer="w", run="exp") as w:
        w.log({"loss": 0.5})
    assert [r.metrics for r in walbuf.read(buffer)] == [{"loss": 0.5}]


def test_a_sync_lock_another_role_holds_is_named_and_never_taken_for_a_running_sync(server, roles):
    buffer, cotenant, database = roles
    as_admin(database, "REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    with walbuf.Writer(buffer, writer="w", run="exp") as w:
        w.log({"loss": 0.5})
    from walbuf.store.postgresql import _pg_lock_keys

    first, second = _pg_lock_keys("sync")
    with psycopg.connect(cotenant, autocommit=True) as holder:  # its keys are in walbuf's source
        holder.execute(f"SELECT pg_advisory_lock(hashtext('walbuf:public') # {first}, {second})")
        proc = subprocess.run(
            [str(os.path.join(os.path.dirname(sys.executable), "walbuf-cron")), buffer],
            capture_output=True,
            text=True,
            env={"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), **server.env()},
            timeout=120,
        )
    assert proc.returncode == 77, proc.stdout + proc.stderr
    assert "held by role 'cotenant_" in proc.stdout
    assert server.runs == {}


def test_a_write_lock_another_role_holds_is_named_at_once(roles):
    buffer, cotenant, database = roles
    as_admin(database, "REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    from walbuf.store.postgresql import _pg_lock_keys

    first, second = _pg_lock_keys("write transaction")
    with psycopg.connect(cotenant, autocommit=True) as holder:
        holder.execute(f"SELECT pg_advisory_lock(hashtext('walbuf:public') # {first}, {second})")
        with pytest.raises(walbuf.UntrustedPathError, match="held by role 'cotenant_"):
            walbuf.Writer(buffer, writer="w", run="exp", wait=0).log({"loss": 0.5})
