"""A bootstrap that cannot read infersight's install says which file, which user and what to fix.

Installed in /opt/infersight without read access for the server's user, the hooked server said only
"bootstrap failed, running without hooks: PermissionError(13, 'Permission denied')" (a review of
the systemd path): no path, no user, no fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import infersight.hooks

BOOTSTRAP = Path(infersight.hooks.__file__).parent / "bootstrap"


def test_an_unreadable_install_is_named(tmp_path: Path) -> None:
    # an infersight package whose import is refused as an unreadable file is (root reads any file)
    fake = tmp_path / "site" / "infersight"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "raise PermissionError(13, 'Permission denied', '/opt/infersight/lib/python3.11/site-packages/x.py')\n")
    env = dict(os.environ, INFERSIGHT="1", PYTHONPATH="%s:%s" % (BOOTSTRAP, tmp_path / "site"))
    env.pop("INFERSIGHT_SOCKET", None)
    r = subprocess.run([sys.executable, "-c", "print('served')"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "served", r.stderr  # the process runs, unhooked
    assert "bootstrap failed, running without hooks" in r.stderr
    assert "/opt/infersight/lib/python3.11/site-packages/x.py" in r.stderr and "uid %d" % os.getuid() in r.stderr
    assert "must be able to read infersight's install" in r.stderr
