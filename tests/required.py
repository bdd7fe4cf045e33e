"""KVPOOL_REQUIRE=all (.ci/run sets it): a test that would skip fails instead, unless it needs a GPU.

A skip for a missing package, library or tool leaves a run green that proved
nothing: the cluster tests skipped because apt could not install Mooncake's
libraries, every comparison with `transformers` skipped because it failed to
import. CI installs every part the suite uses, so there a skip means a broken
install step, and it fails, naming what was missing. The one part a CI machine
truly lacks is a GPU: tests marked `cuda` may still skip. Without the switch
(a developer's machine without the system packages) skips stay skips, and
`-rs` lists each with its reason either way.

A combination of parameters that is no test at all (flex decode on a second
architecture) is not skipped but deselected: a test module names such
combinations in a module-level `inapplicable(params) -> bool`.
"""

from __future__ import annotations

import os

import pytest

VALUES = ("", "all")


def required() -> bool:
    return os.environ.get("KVPOOL_REQUIRE", "") == "all"


def pytest_configure(config: pytest.Config) -> None:
    value = os.environ.get("KVPOOL_REQUIRE", "")
    if value not in VALUES:
        raise pytest.UsageError(f"KVPOOL_REQUIRE={value!r}: use 'all' (every part but a GPU is required) or leave "
                                "it unset")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept, dropped = [], []
    for item in items:
        rule = getattr(getattr(item, "module", None), "inapplicable", None)
        callspec = getattr(item, "callspec", None)
        (dropped if rule is not None and callspec is not None and rule(callspec.params) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    report = yield
    if required() and report.skipped and not hasattr(report, "wasxfail") \
            and item.get_closest_marker("cuda") is None:
        _fail(report, f"{item.nodeid} skipped")
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> pytest.CollectReport:
    report = yield
    if required() and report.skipped:
        _fail(report, f"{collector.nodeid} was not collected")
    return report


def _fail(report: pytest.TestReport | pytest.CollectReport, what: str) -> None:
    longrepr = report.longrepr
    reason = (longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)).removeprefix("Skipped: ")
    report.outcome = "failed"
    report.longrepr = f"{what} under KVPOOL_REQUIRE=all, where only a missing GPU may skip a test: {reason}"
