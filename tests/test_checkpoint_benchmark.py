"""benchmarks.checkpoint_io on a tiny tree: every arm runs, and the report says how."""

import pytest

pytest.importorskip("orbax.checkpoint")

from benchmarks import checkpoint_io  # noqa: E402


def test_tiny_run_times_every_arm_and_writes_its_report(tmp_path):
  out = tmp_path / "checkpoint_io.txt"
  argv = ["--layers", "1", "--d", "16", "--vocab", "32", "--ctx", "8", "--reps", "2",
          "--out", str(out)]
  times = checkpoint_io.main(argv)
  assert sorted(times) == [("checksums", True), ("restore", False), ("restore", True),
                           ("save", False), ("save", True)]
  assert all(len(t) == 2 and min(t) > 0 for t in times.values())
  header, machine, tree, _, columns, _, save, restore, _, alone = out.read_text().splitlines()
  assert header.startswith(f"# python -m benchmarks.checkpoint_io {' '.join(argv)}, on ")
  assert "1-minute load average" in header
  assert machine.startswith("machine: ") and tree.startswith("GPT-2-shaped tree: 1 blocks")
  assert "unverified min / median (ms)" in columns
  assert save.startswith("| save ") and restore.startswith("| restore ")
  assert alone.startswith("checksums alone")
