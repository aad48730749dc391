"""launch's default output file when the working directory cannot hold it.

A container's working directory is often the image's, read-only or root's (the pod manifest's model
server runs as uid 1000): launch used to refuse to start CMD (exit 2, "cannot write the output file")
whenever no agent answered and the default ``infersight-<time>.otlp.jsonl`` could not be made there.
An unwritable *default* must never keep the server from starting: the file goes to the user's state
directory, else the temporary directory (0600, made exclusively), else nowhere, said once on stderr.
An explicit ``--otlp-file`` that cannot be written is still a usage error.
"""

from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

from fleet_env import base_env, make_dir, open_base, require_root, shared_python

UID = 42931
CMD = ["-c", "print('served')"]


def _launch(python: Path, cwd: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), "-m", "infersight", "launch", "--agent", "embedded", *extra, "--",
                           str(python), *CMD], cwd=cwd, env=env, user=UID, group=UID, capture_output=True,
                          text=True, timeout=120)


def test_an_unwritable_working_directory_moves_the_default_file(tmp_path: Path) -> None:
    require_root()
    with open_base("isf-out-") as base:
        python = shared_python(base)
        image = make_dir(base / "app", 0o755)  # root's, as an image's working directory
        home = make_dir(base / "home", 0o700, UID, UID)
        r = _launch(python, image, base_env(HOME=str(home), TMPDIR=str(make_dir(base / "tmp", 0o1777))))
        assert r.returncode == 0, r.stderr
        assert "served" in r.stdout
        state = home / ".local" / "state" / "infersight"
        files = list(state.glob("infersight-*.otlp.jsonl"))
        assert len(files) == 1 and files[0].stat().st_size > 0, r.stderr
        assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
        assert "writing the cold start to %s" % files[0] in r.stderr, r.stderr
        assert not list(image.glob("*.otlp.jsonl"))


def test_no_home_either_goes_to_the_temporary_directory_privately(tmp_path: Path) -> None:
    require_root()
    with open_base("isf-out-") as base:
        python = shared_python(base)
        image = make_dir(base / "app", 0o755)
        temp = make_dir(base / "tmp", 0o1777)
        r = _launch(python, image, base_env(HOME=str(make_dir(base / "roots-home", 0o755)), TMPDIR=str(temp)))
        assert r.returncode == 0, r.stderr
        files = list(temp.glob("infersight-*.otlp.jsonl"))
        assert len(files) == 1 and files[0].stat().st_uid == UID, r.stderr
        assert stat.S_IMODE(files[0].stat().st_mode) == 0o600, "others can read /tmp: the file is private"
        assert files[0].stat().st_size > 0


def test_a_link_planted_at_the_temporary_name_is_not_followed(tmp_path: Path) -> None:
    """Others can write the temporary directory and can guess the name: a symlink planted there is not
    written through; the file gets a name of its own."""
    require_root()
    with open_base("isf-out-") as base:
        python = shared_python(base)
        image = make_dir(base / "app", 0o755)
        temp = make_dir(base / "tmp", 0o1777)
        victim = make_dir(base / "victim", 0o777) / "target"
        victim.write_text("")
        # plant a link at every name this minute and the next could give
        now = time.time()
        for t in (now, now + 60):
            stamp = time.strftime("%Y%m%d-%H%M", time.localtime(t))
            for sec in range(60):
                (temp / ("infersight-%s%02d.otlp.jsonl" % (stamp, sec))).symlink_to(victim)
        r = _launch(python, image, base_env(HOME=str(make_dir(base / "roots-home", 0o755)), TMPDIR=str(temp)))
        assert r.returncode == 0, r.stderr
        assert victim.read_text() == "", "written through a planted link"
        files = [f for f in temp.glob("infersight-*.otlp.jsonl") if not f.is_symlink()]
        assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600, r.stderr


def test_an_explicit_output_file_that_cannot_be_written_is_refused(tmp_path: Path) -> None:
    require_root()
    with open_base("isf-out-") as base:
        python = shared_python(base)
        image = make_dir(base / "app", 0o755)
        r = _launch(python, image, base_env(HOME=str(make_dir(base / "home", 0o700, UID, UID))),
                    "--otlp-file", str(image / "run.otlp.jsonl"))
        assert r.returncode == 2 and "cannot write the output file" in r.stderr, r.stderr
        assert "served" not in r.stdout
        assert not os.path.exists(image / "run.otlp.jsonl")
