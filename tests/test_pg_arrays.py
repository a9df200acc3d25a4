"""A list bound to a PostgreSQL function call as one array literal (`transactions.bound`),
built with one join instead of psycopg adapting the list element by element: the server
reads exactly what psycopg's own adaptation gives it - text with quotes, backslashes,
commas, braces, spaces, unicode, the empty string, the string "NULL" beside NULL itself,
and integers - and anything else is left to psycopg."""

from __future__ import annotations

from typing import Any

import psycopg
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_sessions._postgres.transactions import bound, grouped, in_lists_as_arrays

# Any text PostgreSQL stores (no NUL), weighted towards the characters an array literal
# gives a meaning to.
TEXT = st.text(
    alphabet=st.one_of(
        st.sampled_from(list("\"\\,{} \t\n'NULnul()[]")),
        st.characters(exclude_characters="\x00", exclude_categories=["Cs"]),
    ),
    max_size=12,
)
TEXTS = st.lists(st.one_of(TEXT, st.none(), st.sampled_from(["NULL", "null", ""])), max_size=8)
INTS = st.lists(st.one_of(st.integers(-(2**63), 2**63 - 1), st.none()), max_size=8)


def test_a_list_is_bound_as_the_array_psycopg_would_send(pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True, cursor_factory=psycopg.ClientCursor) as conn:

        def read_back(cast: str, value: Any) -> Any:
            return conn.execute(f"SELECT %s::{cast}", (value,)).fetchone()[0]  # type: ignore[index]

        @settings(max_examples=400, deadline=None)
        @given(TEXTS)
        def texts(values: list[str | None]) -> None:
            literal = bound(values)
            assert isinstance(literal, str)
            assert read_back("text[]", literal) == read_back("text[]", values) == values

        @settings(max_examples=200, deadline=None)
        @given(INTS)
        def ints(values: list[int | None]) -> None:
            literal = bound(values)
            assert isinstance(literal, str)
            assert read_back("bigint[]", literal) == read_back("bigint[]", values) == values

        texts()
        ints()


def test_anything_but_a_flat_list_of_text_or_integers_is_left_to_psycopg() -> None:
    for value in (
        "text",
        7,
        None,
        [True, False],  # bool is an int, but not one PostgreSQL reads as a number
        [1.5],
        [["a"]],
        ["a", 1],  # mixed: psycopg refuses it, so do we
        ("a", "b"),
    ):
        assert bound(value) is value
    assert bound([]) == "{}"


def test_in_lists_are_rewritten_as_arrays_and_their_parameters_grouped() -> None:
    """Each positional `IN (?, ...)` becomes `= ANY(?)` (`NOT IN`: `<> ALL(?)`) with its
    parameters as one array literal; a lone `?`, a quoted `IN (?, ?)`, named parameters and
    `IN (SELECT ...)` are left as they are."""
    statement = (
        "SELECT a FROM t WHERE x = ? AND id IN (?, ?, ?) AND y NOT IN (?)"
        " AND z = 'IN (?, ?)' AND w = ? AND v IN (SELECT ?)"
    )
    rewritten, runs = in_lists_as_arrays(statement)
    assert rewritten == (
        "SELECT a FROM t WHERE x = ? AND id = ANY(?) AND y <> ALL(?)"
        " AND z = 'IN (?, ?)' AND w = ? AND v IN (SELECT ?)"
    )
    assert runs == ((1, 3), (4, 1))
    assert grouped((0, "a", "b", "c", 9, 5, 6), runs) == (0, '{"a","b","c"}', "{9}", 5, 6)
    assert in_lists_as_arrays("SELECT 1 WHERE s.id IN (:a, :b)") == (
        "SELECT 1 WHERE s.id IN (:a, :b)",
        (),
    )


def _filtered(tx: Any, stored: list[Any], wanted: list[Any], negated: bool) -> list[Any]:
    among = ", ".join("?" * len(wanted))
    rows = tx.execute(
        "SELECT v FROM unnest(?::text[]) WITH ORDINALITY AS t(v, n)"
        f" WHERE v {'NOT ' if negated else ''}IN ({among}) ORDER BY n",
        (stored, *wanted),
    ).fetchall()
    return [row[0] for row in rows]


def test_a_statement_s_in_list_reaches_psycopg_as_one_parameter(
    pg_url: str, migrated_schema: str, monkeypatch: Any
) -> None:
    """A `_store` statement with an `IN` list of 500 ids (`_IN_CHUNK`) is sent with one
    parameter for the list, not 500 - psycopg parses a statement of more than 50 anew on
    every execute - and selects the same rows an `IN` list does (SQL's three-valued logic
    with NULL included: `NOT IN` a list holding NULL selects nothing)."""
    from helpers import pg_engine_at

    from trio_sessions._postgres.engine import PgSyncEngine

    sent: list[int] = []
    execute = psycopg.ClientCursor.execute

    def counting(self: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        sent.append(len(params or ()))
        return execute(self, query, params, **kwargs)

    monkeypatch.setattr(psycopg.ClientCursor, "execute", counting)
    ids = [f"id-{n}" for n in range(500)]
    with pg_engine_at(pg_url, migrated_schema, 1.0) as pg:
        engine = PgSyncEngine(pg)
        assert engine.read(_filtered, ["id-7", "x", "id-499"], ids, False) == ["id-7", "id-499"]
        assert sent[-1] == 2

        @settings(max_examples=150, deadline=None)
        @given(stored=TEXTS, wanted=st.lists(st.one_of(TEXT, st.none()), min_size=1, max_size=6))
        def same_rows(stored: list[str | None], wanted: list[str | None]) -> None:
            inside = [v for v in stored if v is not None and v in wanted]
            outside = (
                [] if None in wanted else [v for v in stored if v is not None and v not in wanted]
            )
            assert engine.read(_filtered, stored, wanted, False) == inside
            assert engine.read(_filtered, stored, wanted, True) == outside

        same_rows()


def test_an_in_list_is_rewritten_whatever_its_case_and_spacing() -> None:
    """`NOT IN` spelled in lower case or across a line is `<> ALL(?)` - never the `IN` alone
    rewritten after a `NOT` left standing (`x not = ANY(?)`: not SQL) - and `in (`, `IN(`
    and lists without spaces are lists too."""
    for statement, rewritten in (
        ("SELECT 1 WHERE x not IN (?, ?)", "SELECT 1 WHERE x <> ALL(?)"),
        ("SELECT 1 WHERE x not in (?)", "SELECT 1 WHERE x <> ALL(?)"),
        ("SELECT 1 WHERE x NOT\n   IN (?)", "SELECT 1 WHERE x <> ALL(?)"),
        ("SELECT 1 WHERE x NOT  IN(?,?)", "SELECT 1 WHERE x <> ALL(?)"),
        ("SELECT 1 WHERE x in (?)", "SELECT 1 WHERE x = ANY(?)"),
        ("SELECT 1 WHERE x IN( ?, ? )", "SELECT 1 WHERE x = ANY(?)"),
        (
            "SELECT 1 WHERE not_x IN (?) AND cannot IN (?)",
            "SELECT 1 WHERE not_x = ANY(?) AND cannot = ANY(?)",
        ),
        (
            "SELECT 1 WHERE x JOIN (?) AND x MIN (?) AND x WITHIN (?)",
            "SELECT 1 WHERE x JOIN (?) AND x MIN (?) AND x WITHIN (?)",
        ),
    ):
        assert in_lists_as_arrays(statement)[0] == rewritten, statement
    assert in_lists_as_arrays("SELECT 1 WHERE y = ? AND x not IN (?,  ?) AND z = ?")[1] == ((1, 2),)
