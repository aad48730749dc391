"""``INFERSIGHT_READY_ON_LISTEN`` (``_env.ready_on_listen``): unset, the listening heuristics are off only where
launch's ``--ready-url`` hands the process its ready file; a value set says so everywhere. Launch sets no value
of its own in CMD's environment (``launch.child_env``), so a launch nested in such a run's CMD, which drops the
outer run's file, drops that default with it."""

from __future__ import annotations

import pytest

from infersight.agent.commands.launch import child_env
from infersight.hooks import _env


@pytest.mark.parametrize(("value", "ready_file", "on"), [
    (None, None, True),
    (None, "/tmp/run/ready", False),  # under --ready-url: the URL is the authority
    ("1", "/tmp/run/ready", True),  # ... unless the user said otherwise
    ("0", None, False),
    ("", "/tmp/run/ready", False),  # empty: unset
])
def test_the_default_goes_with_the_ready_file(monkeypatch: pytest.MonkeyPatch, value: str | None,
                                              ready_file: str | None, on: bool) -> None:
    for name, v in (("INFERSIGHT_READY_ON_LISTEN", value), ("INFERSIGHT_READY_FILE", ready_file)):
        if v is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, v)
    assert _env.ready_on_listen() is on


def test_launch_hands_cmd_no_value_of_its_own() -> None:
    outer = child_env({"PATH": "/usr/bin"}, "/tmp/s.sock", None, 1, ready_file="/tmp/outer/ready", boot="/boot")
    assert "INFERSIGHT_READY_ON_LISTEN" not in outer
    nested = child_env(outer, "/tmp/s.sock", None, 1, boot="/boot")  # a launch inside that CMD, no --ready-url
    assert "INFERSIGHT_READY_ON_LISTEN" not in nested and "INFERSIGHT_READY_FILE" not in nested
    mine = child_env(dict(outer, INFERSIGHT_READY_ON_LISTEN="1"), "/tmp/s.sock", None, 1, boot="/boot")
    assert mine["INFERSIGHT_READY_ON_LISTEN"] == "1"  # the user's own value reaches every CMD
