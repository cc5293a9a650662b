"""Byte-level text that ships with every Python install: the standard library's `.py` files.

Vocabulary 256 (raw bytes), no downloads, no tokenizer. Files are split into train and
validation by a hash of their path relative to the root, so the split is the same on
every run and machine with the same Python, and no file is in both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import sysconfig
from collections.abc import Iterator, Sequence
from typing import Optional, Union

import numpy as np

VOCAB_SIZE = 256
# Third-party packages may live under the stdlib dir; they are not the standard library.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> pathlib.Path:
  """Directory of this interpreter's standard library."""
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Union[str, pathlib.Path, None] = None) -> list[pathlib.Path]:
  """Every `.py` file under `root` (default: the stdlib), as sorted relative paths.

  Raises:
    FileNotFoundError: when no `.py` file is found, saying where it looked.
  """
  root = stdlib_root() if root is None else pathlib.Path(root)
  files = sorted(
      p.relative_to(root) for p in root.rglob("*.py")
      if p.is_file() and not _SKIP_DIRS.intersection(p.relative_to(root).parts))
  if not files:
    raise FileNotFoundError(
        f"no .py source files found under {str(root)!r}. This Python may ship without "
        "its standard library sources (some minimal/embedded builds do): install the "
        "full Python (e.g. the python3 package with its lib directory) or pass a "
        "directory of .py files as the root.")
  return files


def is_validation(relative_path: Union[str, pathlib.PurePath], val_percent: int) -> bool:
  """Whether a file belongs to the validation split: a stable hash of its relative path.

  `hashlib` rather than `hash()`, which is salted per process.
  """
  key = pathlib.PurePath(relative_path).as_posix().encode()
  return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") % 100 < val_percent


@dataclasses.dataclass
class Split:
  """One split: the files it holds and their bytes concatenated (uint8)."""

  files: list[pathlib.Path]
  data: np.ndarray


def load_splits(root: Union[str, pathlib.Path, None] = None, *, val_percent: int = 10,
                max_bytes: Optional[int] = None) -> tuple[Split, Split]:
  """(train, validation) splits of the `.py` files under `root` (default: the stdlib).

  Args:
    root: directory searched recursively for `.py` files.
    val_percent: share of files (by path hash, not by size) put in validation.
    max_bytes: if given, each split keeps only its first files up to this many bytes
      (a quick way to make tiny runs cheap to load).

  Raises:
    FileNotFoundError: no `.py` file under `root`.
    ValueError: one of the splits came out empty (too few files for `val_percent`).
  """
  if not 0 < val_percent < 100:
    raise ValueError(f"val_percent must be in (0, 100), got {val_percent}.")
  root = stdlib_root() if root is None else pathlib.Path(root)
  files = source_files(root)
  val = [f for f in files if is_validation(f, val_percent)]
  train = [f for f in files if not is_validation(f, val_percent)]
  for name, part in (("train", train), ("validation", val)):
    if not part:
      raise ValueError(
          f"the {name} split of the {len(files)} .py files under {str(root)!r} is empty; "
          "use a directory with more files or change val_percent.")
  return _read(root, train, max_bytes), _read(root, val, max_bytes)


def _read(root: pathlib.Path, files: Sequence[pathlib.Path], max_bytes: Optional[int]) -> Split:
  chunks, total, kept = [], 0, []
  for f in files:
    if max_bytes is not None and total >= max_bytes:
      break
    b = (root / f).read_bytes()
    chunks.append(b)
    kept.append(f)
    total += len(b)
  return Split(kept, np.frombuffer(b"".join(chunks), dtype=np.uint8))


def batches(data: np.ndarray, batch: int, seq_len: int, seed: int,
            start_step: int = 0) -> Iterator[np.ndarray]:
  """Endless (batch, seq_len + 1) int32 windows at random offsets.

  Batch i is drawn from an RNG seeded by (seed, i) alone: the same seed gives every
  optimizer the same data in the same order, and a run resumed at `start_step` sees
  exactly the batches it would have seen.
  """
  if len(data) <= seq_len + 1:
    raise ValueError(f"{len(data)} bytes of text cannot fill a window of {seq_len + 1}.")
  window = np.arange(seq_len + 1)
  step = start_step
  while True:
    starts = np.random.default_rng((seed, step)).integers(0, len(data) - seq_len - 1, size=batch)
    yield data[starts[:, None] + window].astype(np.int32)
    step += 1


def eval_batches(data: np.ndarray, batch: int, seq_len: int, count: int,
                 seed: int = 0) -> np.ndarray:
  """A fixed (count, batch, seq_len + 1) set of windows, for a comparable validation loss."""
  it = batches(data, batch, seq_len, seed)
  return np.stack([next(it) for _ in range(count)])
