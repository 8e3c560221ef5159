"""A bubblewrap sandbox for grading tests (Docker where bubblewrap is missing); in CI a
missing sandbox fails instead of skipping."""

from __future__ import annotations

import os

import pytest

from agentrl.tools.sandbox import Leases, SandboxUnavailable, make_sandbox

IS_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def grading_sandbox():
    try:
        return make_sandbox("auto", leases=Leases(max(2, os.cpu_count() or 2)))
    except SandboxUnavailable as e:
        if IS_CI:
            pytest.fail(f"no sandbox in CI: {e}")
        pytest.skip(str(e))
