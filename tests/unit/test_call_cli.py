"""`sandboxd call --env`: a call's env from the command line (or from the shell, for secrets)."""

from __future__ import annotations

import pytest

from sandboxd.cli.client_cmds import parse_env


def test_name_value_pairs_and_names_taken_from_the_shell() -> None:
    shell = {"OFFICER_APIFY_TOKEN": "tok-1", "PATH": "/bin"}
    assert parse_env(["PI_SEARXNG_URL=http://10.0.0.7:8080/a=b", "OFFICER_APIFY_TOKEN", "OFFICER_RESOURCES="],
                     shell) == {"PI_SEARXNG_URL": "http://10.0.0.7:8080/a=b", "OFFICER_APIFY_TOKEN": "tok-1",
                                "OFFICER_RESOURCES": ""}
    assert parse_env([], shell) == {}


@pytest.mark.parametrize(("item", "fragment"), [
    ("=x", "must look like NAME=VALUE or NAME"),
    ("1ABC=x", "must look like NAME=VALUE or NAME"),
    ("A B=x", "must look like NAME=VALUE or NAME"),
    ("MISSING", "$MISSING is not set in this shell; export it or give --env MISSING=VALUE"),
])
def test_a_malformed_or_unset_name_is_a_usage_error_naming_it(item: str, fragment: str) -> None:
    with pytest.raises(ValueError, match="--env") as info:
        parse_env([item], {})
    assert fragment in str(info.value)


def test_a_name_given_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="PI_SEARXNG_URL is given twice"):
        parse_env(["PI_SEARXNG_URL=a", "PI_SEARXNG_URL=b"], {})
