"""Response stores: every implementation (memory, SQLite, PostgreSQL) passes the same tests;
SQLite and PostgreSQL also survive a reopen, refuse a newer schema and decode leniently, and
PostgreSQL keeps its rules with writers in several processes."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import attrs
import psycopg
import pytest
import trio
import trio.testing
from rollout.engine._interfaces import ResponseStore, StoredResponse
from rollout.engine._memory import MemoryResponseStore
from rollout.engine._pg_store import PostgresResponseStore, open_postgres_store
from rollout.engine._store import (
    MAX_CHAIN_DEPTH,
    RESPONSES_SCHEMA_VERSION,
    SQLiteResponseStore,
    open_sqlite_store,
)
from rollout.protocol import (
    FunctionCall,
    FunctionCallOutput,
    FunctionTool,
    InputImage,
    InputText,
    Item,
    Message,
    NamespaceTool,
    OutputText,
    Reasoning,
    Response,
    SummaryText,
    Tool,
    Usage,
)

Store = MemoryResponseStore | SQLiteResponseStore | PostgresResponseStore

DEADLINE = 10


def _implements_the_protocol(
    a: MemoryResponseStore, b: SQLiteResponseStore, c: PostgresResponseStore
) -> tuple[ResponseStore, ResponseStore, ResponseStore]:
    """Checked by mypy: every store is a `ResponseStore`."""
    return a, b, c


def make(
    response_id: str,
    *,
    parent_id: str | None = None,
    is_root: bool = False,
    owner: str | None = None,
    text: str = "done",
) -> StoredResponse:
    """A stored response with one item of every kind and both kinds of tool."""
    output: list[Item] = [
        Reasoning(id=f"rs_{response_id}", summary=[SummaryText(text="thinking")]),
        FunctionCall(
            id=f"fc_{response_id}",
            call_id=f"call_{response_id}",
            name="search",
            arguments='{"q": "ünïcode ✓"}',
            status="completed",
            namespace="web",
        ),
        Message(
            id=f"msg_{response_id}",
            role="assistant",
            content=[OutputText(text=text)],
            status="completed",
        ),
    ]
    items: list[Item] = [
        Message(role="developer", content="be brief"),
        Message(
            role="user",
            content=[
                InputText(text="look"),
                InputImage(image_url="https://example.com/a.png", detail="low"),
            ],
        ),
        FunctionCallOutput(call_id="call_prev", output="42"),
        *output,
    ]
    tools: list[Tool] = [
        FunctionTool(name="f", parameters={"type": "object", "properties": {}}, strict=True),
        NamespaceTool(name="web", description="the web", tools=[FunctionTool(name="search")]),
    ]
    response = Response(
        id=response_id,
        created_at=1_700_000_000,
        completed_at=1_700_000_001,
        status="completed",
        model="test-model",
        instructions="be brief",
        output=output,
        previous_response_id=parent_id,
        tools=tools,
        usage=Usage.of(input_tokens=10, output_tokens=5, cached_tokens=2),
        metadata={"k": "v"},
    )
    return StoredResponse(
        response=response,
        items=items,
        instructions="be brief",
        tools=tools,
        parent_id=parent_id,
        is_root=is_root,
        owner=owner,
    )


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """Which store, and where it keeps its data (a synchronous fixture, so that a PostgreSQL
    server that cannot be reached skips the test with its reason)."""
    if request.param == "postgresql":
        urls: Callable[[], str] = request.getfixturevalue("postgres_urls")
        return "postgresql", urls()
    return request.param, str(tmp_path / "nested" / "dir" / "rollout.db")


@pytest.fixture
async def store(where: tuple[str, str]) -> AsyncIterator[Store]:
    kind, location = where
    s: Store
    with trio.fail_after(DEADLINE):
        if kind == "memory":
            s = MemoryResponseStore()
        elif kind == "sqlite":
            s = await open_sqlite_store(location)
        else:
            s = await open_postgres_store(location)
    yield s
    with trio.fail_after(DEADLINE):
        await s.aclose()


async def test_round_trip(store: Store) -> None:
    with trio.fail_after(DEADLINE):
        stored = make("resp_1", owner="alice")
        await store.put(stored)
        assert await store.get("resp_1", owner="alice") == stored
        assert await store.get("resp_missing", owner="alice") is None
        assert await store.delete("resp_1", owner="alice") is True
        assert await store.get("resp_1", owner="alice") is None
        assert await store.delete("resp_1", owner="alice") is False


async def test_owner_isolation(store: Store) -> None:
    with trio.fail_after(DEADLINE):
        alice, anon = make("resp_a", owner="alice"), make("resp_n", owner=None)
        await store.put(alice)
        await store.put(anon)
        assert await store.get("resp_a", owner="bob") is None
        assert await store.get("resp_a", owner=None) is None  # auth off sees only owner None
        assert await store.get("resp_n", owner="alice") is None
        assert await store.get("resp_n", owner=None) == anon
        with pytest.raises(LookupError, match="'resp_a' is not stored"):
            await store.get_chain("resp_a", owner="bob")
        assert await store.get_chain("resp_a", owner="alice") == [alice]
        assert await store.delete("resp_a", owner="bob") is False
        assert await store.delete("resp_a", owner=None) is False
        assert await store.get("resp_a", owner="alice") == alice
        # A put never moves an id to another owner.
        with pytest.raises(ValueError, match="another owner"):
            await store.put(make("resp_a", owner="bob"))
        with pytest.raises(ValueError, match="another owner"):
            await store.put(make("resp_n", owner="alice"))
        assert await store.get("resp_a", owner="alice") == alice
        assert await store.count() == 2


async def test_put_is_idempotent_last_write_wins(store: Store) -> None:
    """Same id twice: one row, holding the last write (a retry is harmless and a response can
    be re-stored with a later status)."""
    with trio.fail_after(DEADLINE):
        first = make("resp_1", owner="alice", text="first")
        second = make("resp_1", owner="alice", text="second", parent_id="resp_0")
        await store.put(first)
        await store.put(first)
        assert await store.count() == 1
        await store.put(second)
        assert await store.count() == 1
        assert await store.get("resp_1", owner="alice") == second


async def put_chain(store: Store, owner: str | None = "alice") -> list[StoredResponse]:
    """r1 (first, no parent) <- r2 <- r3 (a root: compacted) <- r4 <- r5."""
    chain = [
        make("r1", owner=owner),
        make("r2", parent_id="r1", owner=owner),
        make("r3", parent_id="r2", is_root=True, owner=owner),
        make("r4", parent_id="r3", owner=owner),
        make("r5", parent_id="r4", owner=owner),
    ]
    for stored in chain:
        await store.put(stored)
    return chain


async def test_get_chain_stops_at_root(store: Store) -> None:
    with trio.fail_after(DEADLINE):
        r1, r2, r3, r4, r5 = await put_chain(store)
        assert await store.get_chain("r5", owner="alice") == [r5, r4, r3]
        assert await store.get_chain("r3", owner="alice") == [r3]
        assert await store.get_chain("r2", owner="alice") == [r2, r1]
        assert await store.get_chain("r1", owner="alice") == [r1]
        assert await store.get_chain("r5", owner="alice", max_depth=3) == [r5, r4, r3]
        with pytest.raises(LookupError, match="response 'nope' is not stored"):
            await store.get_chain("nope", owner="alice")


async def test_get_chain_too_deep(store: Store) -> None:
    with trio.fail_after(DEADLINE):
        await put_chain(store)
        with pytest.raises(LookupError, match="no root within 2 responses"):
            await store.get_chain("r5", owner="alice", max_depth=2)
        with pytest.raises(ValueError, match="at least 1"):
            await store.get_chain("r5", owner="alice", max_depth=0)


async def test_get_chain_cycle_is_bounded(store: Store) -> None:
    with trio.fail_after(DEADLINE):
        await store.put(make("a", parent_id="b"))
        await store.put(make("b", parent_id="a"))
        with pytest.raises(LookupError, match=f"no root within {MAX_CHAIN_DEPTH} responses"):
            await store.get_chain("a", owner=None)


async def test_get_chain_missing_parent(store: Store) -> None:
    with trio.fail_after(DEADLINE):
        await put_chain(store)
        assert await store.delete("r4", owner="alice")
        with pytest.raises(LookupError, match="response 'r5' names parent 'r4'"):
            await store.get_chain("r5", owner="alice")
        # A parent owned by someone else is a missing parent.
        await store.put(make("r4", parent_id="r3", owner="mallory"))
        with pytest.raises(LookupError, match="names parent 'r4'"):
            await store.get_chain("r5", owner="alice")


@pytest.mark.parametrize("where", ["sqlite", "postgresql"], indirect=True)
async def test_a_write_that_fails_part_way_leaves_nothing(
    store: SQLiteResponseStore | PostgresResponseStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put is one transaction: its items' statement failing (here: a statement the database
    refuses) leaves no response row behind, as a crash between the two statements would; a
    delete likewise takes its row and its items together or not at all."""
    sql = type(store)._sql
    with trio.fail_after(DEADLINE):
        monkeypatch.setattr(store, "_sql", attrs.evolve(sql, put_item="INSERT INTO nowhere"))
        with pytest.raises((sqlite3.Error, psycopg.Error)):
            await store.put(make("resp_1"))
        monkeypatch.setattr(store, "_sql", sql)
        assert await store.get("resp_1", owner=None) is None
        await store.put(make("resp_2"))
        monkeypatch.setattr(store, "_sql", attrs.evolve(sql, delete_items="DELETE FROM nowhere"))
        with pytest.raises((sqlite3.Error, psycopg.Error)):
            await store.delete("resp_2", owner=None)
        monkeypatch.setattr(store, "_sql", sql)
        assert await store.get("resp_2", owner=None) == make("resp_2")
        assert await store.get_item("msg_resp_2", owner=None) is not None


async def test_closed(store: Store) -> None:
    with trio.fail_after(DEADLINE):
        await store.aclose()
        await store.aclose()  # idempotent
        with pytest.raises(trio.ClosedResourceError):
            await store.get("resp_1", owner=None)
        with pytest.raises(trio.ClosedResourceError):
            await store.put(make("resp_1"))


async def test_items_by_id(store: Store) -> None:
    """`item_reference` lookups: an item of a stored response, for its owner only, gone with
    its response."""
    with trio.fail_after(DEADLINE):
        stored = make("resp_1", owner="alice")
        await store.put(stored)
        await store.put(make("resp_n", owner=None))
        assert await store.get_item("fc_resp_1", owner="alice") == stored.items[4]
        assert await store.get_item("msg_resp_1", owner="alice") == stored.items[5]
        assert await store.get_item("fc_resp_1", owner="bob") is None
        assert await store.get_item("fc_resp_1", owner=None) is None
        assert await store.get_item("fc_resp_n", owner=None) is not None
        assert await store.get_item("fc_resp_n", owner="alice") is None
        assert await store.get_item("nope", owner="alice") is None
        assert await store.delete("resp_1", owner="alice")
        assert await store.get_item("fc_resp_1", owner="alice") is None


def with_item(response_id: str, owner: str | None, item_id: str, text: str) -> StoredResponse:
    """A stored response whose input holds a message with a client-chosen id."""
    stored = make(response_id, owner=owner)
    mine = Message(id=item_id, role="user", content=[InputText(text=text)])
    return attrs.evolve(stored, items=[mine, *stored.items])


async def test_item_ids_are_scoped_to_their_owner(store: Store) -> None:
    """Item ids may be chosen by the client: another owner storing an id first neither hides
    nor replaces this owner's item with that id (issue 29: keyed by the id alone, bob's item
    made alice's silently unstored), and deleting bob's response leaves alice's item."""
    with trio.fail_after(DEADLINE):
        await store.put(with_item("resp_b", "bob", "msg_shared", "bob's"))
        await store.put(with_item("resp_a", "alice", "msg_shared", "alice's"))
        await store.put(with_item("resp_n", None, "msg_shared", "nobody's"))
        for owner in ("alice", "bob", None):
            item = await store.get_item("msg_shared", owner=owner)
            assert isinstance(item, Message), owner
            assert item.content == [InputText(text=f"{owner or 'nobody'}'s")]
        assert await store.get_item("msg_shared", owner="carol") is None
        assert await store.delete("resp_b", owner="bob")
        assert await store.get_item("msg_shared", owner="bob") is None
        alices = await store.get_item("msg_shared", owner="alice")
        assert isinstance(alices, Message) and alices.content == [InputText(text="alice's")]
        # Within one owner the first response to store an id keeps it (auth off too).
        await store.put(with_item("resp_a2", "alice", "msg_shared", "alice's again"))
        await store.put(with_item("resp_n2", None, "msg_shared", "nobody's again"))
        for owner in ("alice", None):
            item = await store.get_item("msg_shared", owner=owner)
            assert isinstance(item, Message)
            assert item.content == [InputText(text=f"{owner or 'nobody'}'s")]


async def test_rendered_round_trip(store: Store) -> None:
    """The stored rendering (`_segments.py`) comes back byte for byte, in `get` and chains."""
    with trio.fail_after(DEADLINE):
        blob = bytes(range(256)) * 40
        root = attrs.evolve(make("r1", owner="alice"), rendered=blob)
        child = attrs.evolve(make("r2", parent_id="r1", owner="alice"), rendered=b"\x00")
        await store.put(root)
        await store.put(child)
        assert await store.get_chain("r2", owner="alice") == [child, root]
        got = await store.get("r1", owner="alice")
        assert got is not None and got.rendered == blob


# --- SQLite only -----------------------------------------------------------------------------


async def test_sqlite_aclose_fails_queued_calls(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        store = await open_sqlite_store(tmp_path / "rollout.db")
        outcome: list[str] = []

        async def queued() -> None:
            try:
                await store.count()
            except trio.ClosedResourceError:
                outcome.append("closed")

        async with trio.open_nursery() as nursery:
            async with store._lock:  # stands for a call in flight
                nursery.start_soon(queued)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(store.aclose)
                await trio.testing.wait_all_tasks_blocked()
        assert outcome == ["closed"]
        assert store._conn is None


async def test_sqlite_reopen(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        path = tmp_path / "rollout.db"
        async with await open_sqlite_store(path) as store:
            chain = await put_chain(store)
            anon = make("resp_n")
            await store.put(anon)
        async with await open_sqlite_store(path) as store:
            assert await store.get_chain("r5", owner="alice") == chain[:1:-1]
            assert await store.get("resp_n", owner=None) == anon
            assert await store.count() == 6
        conn = sqlite3.connect(path)
        try:
            assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
            assert conn.execute(
                "SELECT version FROM schema_versions WHERE component = 'responses'"
            ).fetchone() == (RESPONSES_SCHEMA_VERSION,)
        finally:
            conn.close()


async def test_sqlite_refuses_newer_schema(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        path = tmp_path / "rollout.db"
        await (await open_sqlite_store(path)).aclose()
        conn = sqlite3.connect(path)
        with conn:
            conn.execute("UPDATE schema_versions SET version = 99 WHERE component = 'responses'")
        conn.close()
        with pytest.raises(RuntimeError, match="schema version 99, newer"):
            await open_sqlite_store(path)


def newer_body(stored: StoredResponse) -> bytes:
    """`stored`'s body as a newer rollout might write it, with fields this one does not know."""
    import msgpack
    from rollout.protocol import to_wire

    body = {
        "response": {**to_wire(stored.response), "new_field": 1},
        "items": [{**item, "new_field": 2} for item in to_wire(stored.items)],
        "instructions": stored.instructions,
        "tools": to_wire(stored.tools),
        "new_part": [],
    }
    packed: bytes = msgpack.packb(body)
    return packed


async def test_sqlite_decodes_leniently(tmp_path: Path) -> None:
    """A body written by a newer rollout, with fields this one does not know, still reads."""
    with trio.fail_after(DEADLINE):
        path = tmp_path / "rollout.db"
        stored = make("resp_1")
        async with await open_sqlite_store(path) as store:
            await store.put(stored)
        conn = sqlite3.connect(path)
        with conn:
            conn.execute("UPDATE responses SET body = ?", (newer_body(stored),))
        conn.close()
        async with await open_sqlite_store(path) as store:
            assert await store.get("resp_1", owner=None) == stored


async def test_sqlite_corrupt_body(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        path = tmp_path / "rollout.db"
        async with await open_sqlite_store(path) as store:
            await store.put(make("resp_1"))
        conn = sqlite3.connect(path)
        with conn:
            conn.execute("UPDATE responses SET body = ?", (b"\x93\x01\x02\x03",))
        conn.close()
        async with await open_sqlite_store(path) as store:
            with pytest.raises(ValueError, match="'resp_1' could not be decoded"):
                await store.get("resp_1", owner=None)


# The store's tables as the previous schema versions made them (SQLite version 3,
# PostgreSQL version 1): items keyed by their id alone.
SQLITE_V3 = (
    """CREATE TABLE responses (id TEXT PRIMARY KEY, owner TEXT, parent_id TEXT,
    is_root INTEGER NOT NULL CHECK (is_root IN (0, 1)), created_at INTEGER NOT NULL,
    body BLOB NOT NULL, rendered BLOB)""",
    """CREATE TABLE items (id TEXT PRIMARY KEY, response_id TEXT NOT NULL, owner TEXT,
    body BLOB NOT NULL)""",
    "CREATE INDEX items_by_response ON items (response_id)",
)
POSTGRES_V1 = (
    """CREATE TABLE responses (id TEXT PRIMARY KEY, owner TEXT, parent_id TEXT,
    is_root SMALLINT NOT NULL CHECK (is_root IN (0, 1)), created_at BIGINT NOT NULL,
    body BYTEA NOT NULL, rendered BYTEA)""",
    """CREATE TABLE items (id TEXT PRIMARY KEY, response_id TEXT NOT NULL, owner TEXT,
    body BYTEA NOT NULL)""",
    "CREATE INDEX items_by_response ON items (response_id)",
    "CREATE TABLE secrets (name TEXT PRIMARY KEY, value BYTEA NOT NULL)",
    "CREATE TABLE schema_versions (component TEXT PRIMARY KEY, version INTEGER NOT NULL)",
    "INSERT INTO schema_versions VALUES ('responses', 1)",
)


async def put_squatted(store: Store) -> None:
    """What an old store holds after bob squatted `msg_shared`: alice's item is unstored."""
    await store.put(with_item("resp_b", "bob", "msg_shared", "bob's"))
    await store.put(with_item("resp_a", "alice", "msg_shared", "alice's"))
    assert await store.get_item("msg_shared", owner="alice") is None


async def check_migrated(store: Store) -> None:
    """Every old row is kept, and the item bob's squatting left out is back (from alice's
    response body); a later response of alice's does not replace it."""
    for owner in ("alice", "bob"):
        assert await store.get(f"resp_{owner[0]}", owner=owner) is not None
    bobs = await store.get_item("msg_shared", owner="bob")
    assert isinstance(bobs, Message) and bobs.content == [InputText(text="bob's")]
    assert await store.get_item("fc_resp_a", owner="alice") is not None
    alices = await store.get_item("msg_shared", owner="alice")
    assert isinstance(alices, Message) and alices.content == [InputText(text="alice's")]
    await store.put(with_item("resp_a2", "alice", "msg_shared", "alice's again"))
    alices = await store.get_item("msg_shared", owner="alice")
    assert isinstance(alices, Message) and alices.content == [InputText(text="alice's")]


async def test_sqlite_migrates_items_to_owner_keys(tmp_path: Path) -> None:
    """A file of schema version 3 (items keyed by id) is upgraded in place on open."""
    from rollout.engine._store import SQLiteResponseStore, connect, ensure_schema

    path = tmp_path / "rollout.db"
    conn = connect(path)
    ensure_schema(conn, component="responses", version=3, schema=SQLITE_V3, migrations={})
    with trio.fail_after(DEADLINE):
        await put_squatted(SQLiteResponseStore(conn, path))
        conn.close()
        async with await open_sqlite_store(path) as store:
            await check_migrated(store)
    check = sqlite3.connect(path)
    try:
        assert check.execute(
            "SELECT version FROM schema_versions WHERE component = 'responses'"
        ).fetchone() == (RESPONSES_SCHEMA_VERSION,)
        names = {row[0] for row in check.execute("SELECT name FROM sqlite_master")}
        assert "items_v3" not in names and {"items_key", "items_by_response"} <= names
    finally:
        check.close()


async def test_postgres_migrates_items_to_owner_keys(
    postgres_urls: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tables of schema version 1 (items keyed by id) are upgraded in place on open."""
    from rollout.engine._pg import open_pool
    from rollout.engine._pg_store import POSTGRES_RESPONSES_SCHEMA_VERSION

    url = postgres_urls()
    with psycopg.connect(url) as conn:
        for statement in POSTGRES_V1:
            conn.execute(statement)
    with trio.fail_after(DEADLINE):
        pool, conninfo = await open_pool(
            url, component="responses", version=1, schema=(), migrations={}, pool_size=1
        )
        with monkeypatch.context() as patch:  # the version 1 store's statement
            patch.setattr(
                PostgresResponseStore,
                "_sql",
                attrs.evolve(
                    PostgresResponseStore._sql,
                    put_item="INSERT INTO items (id, response_id, owner, body) "
                    "VALUES (%s, %s, %s, %s) ON CONFLICT (id) DO NOTHING",
                ),
            )
            async with PostgresResponseStore(pool, conninfo) as old:
                await put_squatted(old)
        async with await open_postgres_store(url) as store:
            await check_migrated(store)
    with psycopg.connect(url) as conn:
        assert conn.execute(
            "SELECT version FROM schema_versions WHERE component = 'responses'"
        ).fetchone() == (POSTGRES_RESPONSES_SCHEMA_VERSION,)
        assert conn.execute("SELECT name FROM secrets").fetchall() == []  # backfilled once


# --- PostgreSQL only -------------------------------------------------------------------------


async def test_postgres_reopen_and_visible_to_another_process(
    postgres_urls: Callable[[], str],
) -> None:
    """Once `put` returns the response is committed: a new connection sees it, as a follow-up
    landing on another process would, and so does a reopened store."""
    url = postgres_urls()
    with trio.fail_after(DEADLINE):
        async with await open_postgres_store(url) as store:
            chain = await put_chain(store)
            anon = make("resp_n")
            await store.put(anon)
            with psycopg.connect(url) as conn:
                assert conn.execute("SELECT count(*) FROM responses").fetchone() == (6,)
                assert conn.execute("SELECT count(*) FROM items").fetchone() == (18,)
        async with await open_postgres_store(url) as store:
            assert await store.get_chain("r5", owner="alice") == chain[:1:-1]
            assert await store.get("resp_n", owner=None) == anon
            assert await store.count() == 6


async def test_postgres_refuses_newer_schema(postgres_urls: Callable[[], str]) -> None:
    url = postgres_urls()
    with trio.fail_after(DEADLINE):
        await (await open_postgres_store(url)).aclose()
        with psycopg.connect(url) as conn:
            conn.execute("UPDATE schema_versions SET version = 99 WHERE component = 'responses'")
        with pytest.raises(RuntimeError, match="schema version 99, newer"):
            await open_postgres_store(url)


async def test_postgres_processes_starting_together_create_the_tables_once(
    postgres_urls: Callable[[], str],
) -> None:
    url = postgres_urls()
    with trio.fail_after(DEADLINE):
        stores: list[PostgresResponseStore] = []

        async def one() -> None:
            stores.append(await open_postgres_store(url, pool_size=1))

        async with trio.open_nursery() as nursery:
            for _ in range(6):
                nursery.start_soon(one)
        for s in stores:
            await s.aclose()
    assert len(stores) == 6


async def test_postgres_decodes_leniently_and_reports_a_corrupt_body(
    postgres_urls: Callable[[], str],
) -> None:
    url = postgres_urls()
    with trio.fail_after(DEADLINE):
        stored = make("resp_1")
        async with await open_postgres_store(url) as store:
            await store.put(stored)
            await store.put(make("resp_2"))
            with psycopg.connect(url) as conn:
                conn.execute(
                    "UPDATE responses SET body = %s WHERE id = 'resp_1'", (newer_body(stored),)
                )
                conn.execute(
                    "UPDATE responses SET body = %s WHERE id = 'resp_2'", (b"\x93\x01\x02\x03",)
                )
            assert await store.get("resp_1", owner=None) == stored
            with pytest.raises(ValueError, match="'resp_2' could not be decoded"):
                await store.get("resp_2", owner=None)


async def test_postgres_shared_secret_is_made_once(postgres_urls: Callable[[], str]) -> None:
    url = postgres_urls()
    with trio.fail_after(DEADLINE):
        async with await open_postgres_store(url) as a, await open_postgres_store(url) as b:
            key = await a.shared_secret("compaction")
            assert len(key) == 32
            assert await b.shared_secret("compaction") == key
            assert await b.shared_secret("other") != key


async def test_postgres_unreachable_fails_fast_with_the_reason() -> None:
    """A server that refuses connections: opening fails at once with psycopg's error."""
    with trio.fail_after(DEADLINE):
        with pytest.raises(psycopg.OperationalError, match=r"127\.0\.0\.1"):
            await open_postgres_store("postgresql://nobody@127.0.0.1:1/none")


# One writer process: stores, when told to go, 20 responses every writer also stores (the last
# write wins) and a chain of its own, then prints the ids it stored.
REPO_ROOT = str(Path(__file__).resolve().parent.parent)
STORE_WRITER = """
import json, sys, trio
sys.path.insert(0, sys.argv[3])
from tests.test_store import make
from rollout.engine._pg_store import open_postgres_store

url, seed = sys.argv[1], int(sys.argv[2])

async def main():
    async with await open_postgres_store(url, pool_size=2) as store:
        print("ready", flush=True)
        sys.stdin.readline()
        for k in range(20):
            await store.put(make(f"shared_{k}", owner="alice", text=f"writer {seed}"))
        own = [f"own_{seed}_{k}" for k in range(5)]
        for k, rid in enumerate(own):
            await store.put(make(rid, owner="alice", parent_id=own[k - 1] if k else None))
    print(json.dumps(own), flush=True)

trio.run(main)
"""


async def test_postgres_writers_in_several_processes(postgres_urls: Callable[[], str]) -> None:
    """Four processes store at once: one row per id (a shared id holds one writer's whole
    response), and each process's chain is whole from any other connection."""
    from tests.test_ledger import PROCESS_DEADLINE, WRITERS, run_writers

    url = postgres_urls()
    with trio.fail_after(PROCESS_DEADLINE):
        async with await open_postgres_store(url) as store:
            outputs = await run_writers(STORE_WRITER, url, WRITERS, REPO_ROOT)
            assert await store.count() == 20 + 5 * WRITERS
            for k in range(20):
                got = await store.get(f"shared_{k}", owner="alice")
                assert got is not None
                text = got.response.output[-1]
                assert text == got.items[-1]  # body and items from the same write
            for own in outputs:
                chain = await store.get_chain(own[-1], owner="alice")
                assert [s.response.id for s in chain] == own[::-1]
