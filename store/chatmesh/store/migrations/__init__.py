"""Alembic migrations of the conversation store (run through `chatmesh.store.migrate`)."""
