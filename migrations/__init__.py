"""Alembic migrations of the walbuf buffer schema (installed as walbuf.migrations)."""
