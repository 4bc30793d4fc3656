"""Searching sessions through the REST API (``search``)."""

from __future__ import annotations

import warnings

from tinker import types


def search(rest, **fields) -> types.SessionSearchResponse:
    with warnings.catch_warnings():  # the SDK marks search_sessions experimental
        warnings.simplefilter("ignore")
        return rest.search_sessions(types.SessionSearchRequest(**fields)).result()
