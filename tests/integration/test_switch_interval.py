"""``SwitchInterval``: the output rank's GIL switch interval is set while R3's output side is
open and put back after, and ``keep`` leaves the interpreter's own."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator

import pytest

from vllm_artifact.integration.switch_interval import SwitchInterval


@pytest.fixture(autouse=True)
def interpreter_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def test_sets_the_interval_and_restores_the_one_it_found() -> None:
    switch = SwitchInterval(0.5)
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    switch.restore()
    assert sys.getswitchinterval() == pytest.approx(0.005)
    switch.restore()  # a second restore changes nothing
    assert sys.getswitchinterval() == pytest.approx(0.005)


@pytest.mark.parametrize("milliseconds", [1.1, 0.05, 100.0])
def test_intervals_the_interpreter_rounds_are_restored_too(milliseconds: float) -> None:
    switch = SwitchInterval(milliseconds)
    assert sys.getswitchinterval() == pytest.approx(milliseconds / 1e3)
    switch.restore()
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_keep_leaves_the_interval() -> None:
    switch = SwitchInterval("keep")
    assert sys.getswitchinterval() == pytest.approx(0.005)
    switch.restore()
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_restore_leaves_an_interval_someone_set_since() -> None:
    switch = SwitchInterval(0.5)
    sys.setswitchinterval(0.002)
    switch.restore()
    assert sys.getswitchinterval() == pytest.approx(0.002)


def test_the_change_is_logged_where_vllm_logs_ours(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="vllm.artifact.worker"):
        SwitchInterval(0.5).restore()
        SwitchInterval("keep").restore()
    assert [r.getMessage() for r in caplog.records if r.name == "vllm.artifact.worker"] == [
        "vllm-artifact: GIL switch interval 5 ms -> 0.5 ms (--artifact-switch-interval-ms)"
    ]
