"""The package works from a wheel, not only from an editable checkout: the shipped strategy
files travel as package data and are found relative to the installed package."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from launching import REPO, env


def test_strategy_files_ship_in_the_wheel(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(REPO), "-w", str(tmp_path)],
        check=True,
        cwd=tmp_path,
        capture_output=True,
        timeout=300,
    )
    wheel = next(tmp_path.glob("harness-*.whl"))
    shipped = sorted(Path(n).name for n in zipfile.ZipFile(wheel).namelist() if n.startswith("harness/config/ds_configs/"))
    assert shipped == sorted(p.name for p in (REPO / "harness" / "config" / "ds_configs").glob("*.json"))
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    e = env()
    e["PYTHONPATH"] = str(unpacked)  # only the wheel's copy of harness is importable (cwd is not the repo)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import harness.config as c; s = c.load_strategy('zero3'); "
            "print('DIR', c.DS_CONFIG_DIR); print('STRATEGY', s.kind, s.zero_stage)",
        ],
        cwd=tmp_path,
        env=e,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.splitlines()
    found = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out if line.startswith(("DIR ", "STRATEGY "))}
    assert found["DIR"].startswith(str(unpacked)) and found["STRATEGY"] == "deepspeed 3", out
