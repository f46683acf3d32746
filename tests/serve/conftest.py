"""The servers the tests of ``lapse serve`` share (:mod:`server_helpers`)."""

from __future__ import annotations

import pytest
from server_helpers import fake_server, serving


@pytest.fixture(scope="module")
def fake():
    """A fake server: (base URL, engine)."""
    app, engine = fake_server(rows=2, pages=64, delay=0.002)
    with serving(app) as url:
        yield url, engine
    engine.stop()
