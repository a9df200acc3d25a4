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

from trio_sessions._postgres.transactions import bound

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
