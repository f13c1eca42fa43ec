"""The `harness` package at import: the collector is held only when a harness entry point is the program, and
`imports_done()` freezes the imports and turns collection back on (in this process: every
change undone)."""

from __future__ import annotations

import gc
import importlib.machinery
import sys
import types
from pathlib import Path

import pytest

import harness as startup

HARNESS_DIR = Path(startup.__file__).parent


def _main_module(spec_name: str | None = None, file: str | None = None) -> types.ModuleType:
    main = types.ModuleType("__main__")
    main.__spec__ = importlib.machinery.ModuleSpec(spec_name, None) if spec_name else None
    if file is not None:
        main.__file__ = file
    return main


@pytest.mark.parametrize(
    ("main", "entry"),
    [
        (_main_module("harness.train"), True),  # python -m harness.train
        (_main_module("harness.data.__main__"), True),  # python -m harness.data
        (_main_module(file=str(HARNESS_DIR / "train.py")), True),  # torchrun / accelerate / deepspeed harness/train.py
        (_main_module("pytest.__main__"), False),  # python -m pytest
        (_main_module(file=str(HARNESS_DIR.parent / "tests" / "integration" / "test_pruning_dist.py")), False),  # a test's rank script
        (_main_module(), False),  # python -c, an interactive session, a notebook kernel
    ],
)
def test_only_a_harness_entry_point_as_the_program_holds_the_collector(monkeypatch, main, entry) -> None:
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert startup._program_is_a_harness_entry_point() is entry


@pytest.mark.parametrize(
    ("orig_argv", "entry"), [(["python", "-u", "-m", "harness.planner.measure", "--runs"], True), (["python", "-m", "pytest"], False)]
)
def test_python_dash_m_is_read_from_the_command_line_while_runpy_imports_the_package(monkeypatch, orig_argv, entry) -> None:
    monkeypatch.setitem(sys.modules, "__main__", _main_module())
    monkeypatch.setattr(sys, "argv", ["-m"])
    monkeypatch.setattr(sys, "orig_argv", orig_argv)
    assert startup._program_is_a_harness_entry_point() is entry


def test_this_process_was_not_held() -> None:
    assert not startup._held and gc.isenabled()


def test_imports_done_freezes_and_collects_again(monkeypatch) -> None:
    assert gc.isenabled()
    before = gc.get_freeze_count()
    monkeypatch.setattr(startup, "_held", True)
    gc.disable()
    try:
        startup.imports_done()
        assert gc.isenabled() and gc.get_freeze_count() > before and not startup._held
        frozen = gc.get_freeze_count()
        startup.imports_done()  # once only: a second call changes nothing
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
        gc.enable()
