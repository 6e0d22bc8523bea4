"""The auth_ tables on both databases the store runs on: the embedded SQLite file and PostgreSQL (its own schema,
so nothing here touches the store's tables)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from chatmesh.gateway.accounts import Accounts, check_password, hash_password, open_accounts
from chatmesh.mesh import errors


@pytest.fixture(params=["sqlite", "postgres"])
async def accounts(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Accounts]:
    if request.param == "sqlite":
        found = open_accounts("", str(tmp_path))
        yield found
        await found.close()
        return
    url: str = request.getfixturevalue("postgres_url")
    schema = f"auth_test_{uuid.uuid4().hex[:12]}"
    admin = create_async_engine(url)
    async with admin.begin() as conn:
        await conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    engine = create_async_engine(url, connect_args={"server_settings": {"search_path": schema}})
    found = Accounts(engine)
    try:
        yield found
    finally:
        await found.close()
        async with admin.begin() as conn:
            await conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        await admin.dispose()


async def test_users_keys_sessions(accounts: Accounts) -> None:
    await asyncio.gather(accounts.create_tables(), accounts.create_tables())  # concurrent starts are fine
    owner = await accounts.create_user("alice", "pw")
    with pytest.raises(errors.Conflict):
        await accounts.create_user("alice")
    key = await accounts.create_key("alice")
    assert await accounts.owner_for_key(key) == owner
    assert await accounts.owner_for_key(key + "x") is None
    assert await accounts.login("alice", "wrong") is None
    session = await accounts.login("alice", "pw")
    assert session is not None and session.owner == owner
    found = await accounts.session(session.token)
    assert found is not None and found.csrf_token == session.csrf_token
    await accounts.end_session(session.token)
    assert await accounts.session(session.token) is None
    assert await accounts.revoke_key(key)
    assert not await accounts.revoke_key(key)


def test_password_hash_is_salted_scrypt() -> None:
    one, two = hash_password("secret"), hash_password("secret")
    assert one != two and one.startswith("scrypt$")
    assert check_password("secret", one) and not check_password("Secret", one)
    assert not check_password("secret", "garbage")


async def test_digests_are_keyed_by_the_pepper(tmp_path: Path) -> None:
    peppered = open_accounts("", str(tmp_path), pepper="pepper-one")
    await peppered.create_tables()
    owner = await peppered.create_user("ida")
    key = await peppered.create_key("ida")
    other = open_accounts("", str(tmp_path), pepper="pepper-two")
    try:
        assert await peppered.owner_for_key(key) == owner
        assert await other.owner_for_key(key) is None  # the tables alone do not confirm a key
        async with peppered._engine.connect() as conn:  # noqa: SLF001 - what is stored
            stored = await conn.scalar(sa.text("select key_digest from auth_api_keys"))
        assert stored == peppered.digest(key) != other.digest(key)
    finally:
        await peppered.close()
        await other.close()


async def test_auth_tables_live_in_the_configured_schema(postgres_url: str) -> None:
    """CHATMESH_DATABASE_SCHEMA puts the gateway's auth_ tables in that schema, as it does the store's."""
    from chatmesh.gateway.cli import accounts_for
    from chatmesh.mesh.config import Config

    schema = f"auth_schema_{uuid.uuid4().hex[:12]}"
    admin = create_async_engine(postgres_url)
    async with admin.begin() as conn:
        await conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    found = accounts_for(Config(env={"CHATMESH_DATABASE_URL": postgres_url, "CHATMESH_DATABASE_SCHEMA": schema}))
    try:
        await found.create_tables()
        owner = await found.create_user("carol")
        async with admin.connect() as conn:
            tables = set((await conn.execute(sa.text(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = :s"), {"s": schema})).scalars())
            row = (await conn.execute(sa.text(f'SELECT user_id FROM "{schema}".auth_users'))).scalar_one()
        assert {"auth_users", "auth_api_keys", "auth_sessions"} <= tables
        assert row == owner
    finally:
        await found.close()
        async with admin.begin() as conn:
            await conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        await admin.dispose()
