"""runtime.env.env_get against os.environ.get: every way a variable changes is seen by the next read."""

from __future__ import annotations

import os

import pytest

from gc_moe_compat.runtime import env
from gc_moe_compat.runtime.env import env_get
from gc_moe_compat.runtime.split import deep_ep_partition_mode
from gc_moe_compat.runtime.status import spin_timeout_setting

NAME = "GC_MOE_TEST_ENV_GET"


@pytest.fixture(params=["dict", "os.environ.get"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both read paths: the dict of os.environ (POSIX CPython) and the fallback."""
    if request.param == "dict":
        assert env._FAST, "os.environ on this Python keeps a dict of bytes"
    else:
        monkeypatch.setattr(env, "_FAST", False)
    return request.param


def test_unset_set_changed_deleted(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NAME, raising=False)
    assert env_get(NAME) is None
    monkeypatch.setenv(NAME, "12.5")
    assert env_get(NAME) == "12.5"
    os.environ[NAME] = "ünïcode value"
    assert env_get(NAME) == os.environ.get(NAME) == "ünïcode value"
    os.environ[NAME] = ""
    assert env_get(NAME) == ""
    del os.environ[NAME]
    assert env_get(NAME) is None
    os.environ.update({NAME: "7"})
    assert env_get(NAME) == "7"
    assert os.environ.pop(NAME) == "7"
    assert env_get(NAME) is None


def test_the_settings_read_through_it_see_the_next_change(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GC_MOE_SPIN_TIMEOUT_MS", raising=False)
    monkeypatch.delenv("GC_MOE_DEEP_EP_PARTITION", raising=False)
    assert spin_timeout_setting() is None
    assert deep_ep_partition_mode() == "off"
    monkeypatch.setenv("GC_MOE_SPIN_TIMEOUT_MS", "250")
    monkeypatch.setenv("GC_MOE_DEEP_EP_PARTITION", " on ")
    assert spin_timeout_setting() == "250"
    assert deep_ep_partition_mode() == "on"
    monkeypatch.setenv("GC_MOE_DEEP_EP_PARTITION", "sideways")
    with pytest.raises(ValueError, match="GC_MOE_DEEP_EP_PARTITION: must be one of .* got 'sideways'"):
        deep_ep_partition_mode()


def test_a_rebound_os_environ_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A harness that replaces os.environ (mock.patch("os.environ", {...})) gets what it put there."""
    monkeypatch.setenv(NAME, "real")
    monkeypatch.setattr(os, "environ", {NAME: "replaced"})
    assert env_get(NAME) == "replaced"
    monkeypatch.setattr(os, "environ", {})
    assert env_get(NAME) is None
