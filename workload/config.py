"""What defines one training run of the workload, with no jax import, so that a command
line can be parsed (and XLA_FLAGS set from it) before jax is imported."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any, Optional

# The optimizers a run can use: the Muon family (hidden matrices; AdamW for the rest) and
# the all-AdamW baseline. The frontier: NorDion2 at fractions 0.25 (its default), 0.5 and
# 1; MuonBP with periods 4 and 8 (the blocks of 8 devices); Muon and NorMuon with weight
# decay 0.1, plain and cautious; MuonH (the hyperball); Muon without Nesterov (as Dion2's
# buffer has none).
FRONTIER = ("nordion2", "nordion2-0.5", "nordion2-1", "muonbp4", "muonbp8", "muon-wd",
            "muon-cwd", "normuon-wd", "normuon-cwd", "muonh", "muon-no-nesterov")
OPTIMIZERS = ("muon", "normuon", "adamuon", "adaptive", *FRONTIER, "adamw")
# Peak learning rates: the best of each optimizer's sweep on the default configuration
# (benchmarks/results/convergence.txt, frontier.txt; tests/test_train_gpt.py checks that
# they agree). AdamW's is also every aux AdamW's.
BEST_LR = {"muon": 0.04, "normuon": 0.04, "adamuon": 0.016, "adaptive": 0.8, "adamw": 6e-3,
           "nordion2": 0.02, "nordion2-0.5": 0.02, "nordion2-1": 0.02, "muonbp4": 0.02,
           "muonbp8": 0.02, "muon-wd": 0.04, "muon-cwd": 0.04, "normuon-wd": 0.04,
           "normuon-cwd": 0.04, "muonh": 0.04, "muon-no-nesterov": 0.02}
# The weight decay of the decay presets (-wd plain, -cwd cautious) unless --weight-decay
# gives another; every other optimizer decays only by --weight-decay.
PRESET_DECAY = {name: 0.1 for name in ("muon-wd", "muon-cwd", "normuon-wd", "normuon-cwd")}
BLOCK_DEVICES = 8  # MuonBP presets: the blocks of this many devices
NS_PRESETS = ("turbo", "jordan", "polar_express", "deepseek_v4", "cubic5")


def simulate_devices(count: int) -> None:
  """Makes this CPU process show `count` devices, as long as jax is not imported yet:
  XLA reads the flag once, at import."""
  if count > 1 and "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={count}").strip()


def _flag(default: Any, help: str) -> Any:
  return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass
class TrainConfig:
  """Everything that defines one run; every field is a command-line flag."""

  optimizer: str = _flag("muon", f"one of {OPTIMIZERS} (adaptive: muon(scale='adaptive'))")
  steps: int = _flag(350, "training steps")
  d_model: int = _flag(64, "model width")
  layers: int = _flag(2, "transformer blocks")
  heads: int = _flag(4, "attention heads")
  seq_len: int = _flag(64, "context length in bytes")
  batch: int = _flag(32, "sequences per step (split over --devices)")
  lr: Optional[float] = _flag(None, "peak learning rate of the hidden matrices (default: "
                              "the optimizer's best in benchmarks/results/convergence.txt "
                              "or frontier.txt)")
  adam_lr: Optional[float] = _flag(None, "AdamW's peak learning rate (the aux branch, or "
                                   f"everything; default {BEST_LR['adamw']})")
  ns: str = _flag("turbo", f"Newton–Schulz preset, one of {NS_PRESETS}")
  weight_decay: Optional[float] = _flag(None, "decoupled weight decay of the hidden matrices "
                                        "(default: 0.1 for the -wd / -cwd presets, else 0)")
  warmup: float = _flag(0.05, "fraction of steps of linear warmup, then cosine decay to 10%%")
  seed: int = _flag(0, "model init and data order")
  eval_every: int = _flag(50, "steps between validation losses")
  eval_batches: int = _flag(8, "fixed validation batches")
  devices: int = _flag(1, "data-parallel devices (simulated on CPU)")
  data_root: str = _flag("", "a directory of .py files (default: this Python's stdlib)")
  tie_embeddings: bool = _flag(False, "use the token embedding as the output head")
  attention: str = _flag("mha", "mha (separate q, k, v kernels) or fused (one (d, 3d) qkv "
                         "kernel, its product split in three)")
  split_fused: bool = _flag(True, "orthogonalize a fused qkv kernel as its q, k and v blocks, "
                            "as infer_routing finds them (false: as one matrix)")
  out_dir: str = _flag("runs/train_gpt", "where loss.png and run.json go")
  # Batch i is drawn from (seed, i) alone, so model, optimizer state and step are all a
  # resume needs.
  checkpoint_dir: str = _flag("", "save model and optimizer every --eval-every steps (Orbax), "
                              "in a subdirectory per optimizer")
  resume: bool = _flag(False, "continue from the latest checkpoint in --checkpoint-dir")

  def __post_init__(self):
    if self.optimizer not in OPTIMIZERS:
      raise ValueError(f"unknown optimizer {self.optimizer!r}; use one of {OPTIMIZERS}.")
    if self.attention not in ("mha", "fused"):
      raise ValueError(f"unknown attention {self.attention!r}; use mha or fused.")
    if self.ns not in NS_PRESETS:
      raise ValueError(f"unknown Newton–Schulz preset {self.ns!r}; use one of {NS_PRESETS}.")
    if self.weight_decay is not None and not self.weight_decay >= 0:
      raise ValueError(f"--weight-decay must be ≥ 0, got {self.weight_decay}.")
    if self.optimizer.startswith("muonbp") and self.devices not in (1, BLOCK_DEVICES):
      raise ValueError(f"--optimizer {self.optimizer} takes the blocks of {BLOCK_DEVICES} devices: "
                       f"run it with --devices 1 (the blocks simulated) or {BLOCK_DEVICES}, "
                       f"not {self.devices}.")

  def resolved(self) -> TrainConfig:
    """This config with the weight decay that acts in place of "the optimizer's own":
    what a run records."""
    if self.weight_decay is not None:
      return self
    return dataclasses.replace(self, weight_decay=PRESET_DECAY.get(self.optimizer, 0.0))

  @property
  def peak_lr(self) -> float:
    """The hidden matrices' peak learning rate (AdamW's for the all-AdamW run)."""
    if self.optimizer == "adamw":
      return self.peak_adam_lr
    return BEST_LR[self.optimizer] if self.lr is None else self.lr

  @property
  def peak_adam_lr(self) -> float:
    return BEST_LR["adamw"] if self.adam_lr is None else self.adam_lr


# The fields whose flags take one of a few values.
CHOICES = {"optimizer": OPTIMIZERS, "ns": NS_PRESETS, "attention": ("mha", "fused")}


def add_flags(parser: argparse.ArgumentParser, names: Optional[list[str]] = None,
              **defaults: Any) -> None:
  """A --flag per `TrainConfig` field in `names` (default all), with the field's help,
  type and choices, and its default unless `defaults` gives the script's own: the one
  source of the scripts' model, data and training flags."""
  base = TrainConfig()
  fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
  for name in names or list(fields):
    value = defaults.get(name, getattr(base, name))
    kwargs: dict[str, Any] = {"help": fields[name].metadata["help"], "default": value}
    if name in CHOICES:
      kwargs["choices"] = CHOICES[name]
    if isinstance(getattr(base, name), bool):
      kwargs["action"] = argparse.BooleanOptionalAction
    else:
      kwargs["type"] = (float if name in ("lr", "adam_lr", "weight_decay")
                        else type(getattr(base, name)))
    parser.add_argument("--" + name.replace("_", "-"), **kwargs)
