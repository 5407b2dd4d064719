"""bench/overhead.py runs and writes its JSON and table (no assertion on wall time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench" / "overhead.py"


@pytest.mark.slow
def test_overhead_smoke(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(BENCH), "--model", "micro", "--rounds", "2", "--steps", "1",
                        "--batch-size", "2", "--seq-len", "16", "--vocab-size", "300", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["rounds_kept"] == 1 and len(result["atoll_rounds_s_per_step"]) == 1
    assert result["atoll_median_s_per_step"] > 0 and result["plain_median_s_per_step"] > 0
    assert "plain PyTorch" in (tmp_path / "results.md").read_text()
    assert result["max_weight_diff"] < 1e-5  # the same maths on both sides
