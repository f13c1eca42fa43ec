"""Bad input that only shows once the run has started (the data is read, the model built) still
ends in one line and exit 2, not a traceback: a global batch larger than the training set
(which once made the sampler loop for minutes), a corrupt line deep in a data file (past
what pre-flight samples), under one process and under torchrun."""

from __future__ import annotations

import json

import pytest
from launching import REPO, launch_command, run, side_by_side, tiny_config

from harness.data import embedded_documents


def _one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("harness: error: ")]
    assert len(lines) == 1 and f'File "{REPO / "harness"}' not in stderr, stderr[-3000:]  # no frame of ours
    return lines[0]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, data_cache, tiny_data) -> dict:
    """Both cases under one process, side by side (each uses one of the two cores; see
    `launching.side_by_side`; the data cache ready first: `tiny_data`): name -> (config, process,
    data file)."""
    root = tmp_path_factory.mktemp("bad_input")
    big = tiny_config(root / "big.yaml", data_cache, root / "big", micro_batch_size=100_000)
    corpus = root / "docs.jsonl"
    with open(corpus, "w") as f:
        for doc in embedded_documents()[:300]:  # well past the 64 KiB pre-flight decodes
            f.write(json.dumps({"text": doc}) + "\n")
        f.write('{"text": "a line cut short\n')
    corrupt = tiny_config(root / "corrupt.yaml", data_cache, root / "corrupt", **{"data.source": str(corpus)})
    procs = side_by_side(*(lambda c=c: run(launch_command("python", 1, c, []), timeout=300, check=False) for c in (big, corrupt)))
    return {"big": (big, procs[0], None), "corrupt": (corrupt, procs[1], corpus)}


def test_a_global_batch_larger_than_the_data_is_refused(one_process):
    cfg, proc, _ = one_process["big"]
    assert proc.returncode == 2
    assert "global batch (200000 blocks" in _one_error_line(proc.stderr) and "exceeds the" in proc.stderr
    two = run(launch_command("torchrun", 2, cfg, []), timeout=300, check=False)
    assert two.returncode != 0 and "(exitcode: 2)" in two.stderr and "exceeds the" in two.stderr


def test_a_corrupt_line_deep_in_a_data_file_is_one_line(one_process):
    _, proc, corpus = one_process["corrupt"]
    assert proc.returncode == 2
    line = _one_error_line(proc.stderr)
    assert f"data.source '{corpus}' could not be read" in line and "fix or remove the file" in line
