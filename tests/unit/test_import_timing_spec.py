"""Import timing marks a found module's spec, never its loader; once the module is loaded (or
failed), the spec is a plain ``ModuleSpec`` again and the post-import callbacks ran only for a
module that loaded."""

from __future__ import annotations

import importlib.util
import sys
from importlib.machinery import ModuleSpec, SourceFileLoader
from pathlib import Path
from typing import Any

import pytest

from infersight.hooks import _imports


def _load(tmp_path: Path, name: str, body: str) -> tuple[ModuleSpec, Any]:
    path = tmp_path / (name + ".py")
    path.write_text(body)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    _imports._timed(spec, 0)
    assert type(spec) is _imports._TimedSpec
    loaded: Any = None
    try:
        import importlib._bootstrap as bootstrap  # the import system's own load, as an import does

        loaded = bootstrap._load(spec)
    finally:
        sys.modules.pop(name, None)
    return spec, loaded


def test_a_timed_spec_is_plain_again_with_the_real_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, Any]] = []
    monkeypatch.setattr(_imports.cs, "run_post_import", lambda name, module: seen.append((name, module)))
    spec, module = _load(tmp_path, "timed_ok_mod", "X = 1\n")
    assert type(spec) is ModuleSpec
    assert not [k for k in vars(spec) if k.startswith("_infersight")]
    assert spec._initializing is False  # type: ignore[attr-defined]
    assert isinstance(spec.loader, SourceFileLoader)
    assert isinstance(module.__loader__, SourceFileLoader) and module.__spec__ is spec
    assert module.X == 1
    assert seen == [("timed_ok_mod", module)]


def test_a_failed_load_runs_no_callback_and_leaves_a_plain_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []
    monkeypatch.setattr(_imports.cs, "run_post_import", lambda name, module: seen.append(name))
    path = tmp_path / "timed_bad_mod.py"
    path.write_text("raise RuntimeError('boom')\n")
    spec = importlib.util.spec_from_file_location("timed_bad_mod", path)
    assert spec is not None
    _imports._timed(spec, 0)
    import importlib._bootstrap as bootstrap

    with pytest.raises(RuntimeError, match="boom"):
        bootstrap._load(spec)
    assert "timed_bad_mod" not in sys.modules
    assert type(spec) is ModuleSpec
    assert not [k for k in vars(spec) if k.startswith("_infersight")]
    assert seen == []
