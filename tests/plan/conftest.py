"""The planner's tests: pure Python, no process group; the page's in Debian's chromium,
driven by playwright (skipped without them, failed instead under
``ZEROSHARD_REQUIRE_BROWSER=1``, as CI sets it).
"""

from __future__ import annotations

import pytest

from zeroshard.plan.page import write_page

from .page_browser import Session, launch, need_browser


@pytest.fixture(scope="session")
def browser():
    """One chromium for every page test."""
    need_browser()
    with launch() as b:
        yield b


@pytest.fixture(scope="module")
def session(browser, tmp_path_factory):
    """The planner page, written fresh, open in a tab of its own."""
    s = Session(browser, write_page(tmp_path_factory.mktemp("page") / "plan.html"))
    yield s
    s.context.close()
