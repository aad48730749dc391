"""CMD's environment (``launch.child_env``): an outer ``--ready-url`` run's ready file reaches every process of its
CMD (spawned workers are ready by its answer once they serve), so a launch nested inside that CMD must not hand it
on to its own CMD as that CMD's readiness."""

from __future__ import annotations

from infersight.agent.commands.launch import child_env


def test_a_nested_launch_drops_the_outer_runs_ready_file() -> None:
    outer = {"INFERSIGHT_READY_FILE": "/tmp/outer/ready", "PATH": "/usr/bin"}
    env = child_env(outer, "/tmp/s.sock", None, 1, boot="/boot")
    assert "INFERSIGHT_READY_FILE" not in env
    mine = child_env(outer, "/tmp/s.sock", None, 1, ready_file="/tmp/inner/ready", boot="/boot")
    assert mine["INFERSIGHT_READY_FILE"] == "/tmp/inner/ready"
