"""scripts/one_row_profile.py's summary of a py-spy raw file: each frame's share of the samples, by
innermost frame and anywhere on the stack (a frame counted once per sample however often it recurs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "one_row_profile.py"


def test_the_summary_shares_the_samples_by_frame(tmp_path: Path) -> None:
    raw = tmp_path / "one_row.raw"
    raw.write_text("main;step;matmul 6\nmain;step;attention 3\nmain;step;step 1\nmain;load 40\n")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--summarise", str(raw), "--top", "2", "--within", "step"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    innermost, anywhere = out.split("by anywhere on the stack:")
    assert "10 samples" in out
    assert " 60.0%  matmul" in innermost and " 30.0%  attention" in innermost and "step" not in innermost
    assert "100.0%  main" in anywhere and "100.0%  step" in anywhere and "matmul" not in anywhere
