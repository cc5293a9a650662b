"""Symmetric products: X Xᵀ and Newton–Schulz with the upper block triangle mirrored,
against the whole products XLA computes.

Per timed shape, the arms take turns call by call (`common.time_interleaved`):
- X Xᵀ as one product ("whole"), and from its upper block triangle in b block rows
  (`--blocks`), b = 1 being the whole product;
- `newton_schulz` with the default settings, with their turbo in the standard iteration
  (`gram=False`) and with jordan's standard 5 steps, each with whole products and with
  symmetric ones in the library's own block count.
Columns: compiled flops (XLA's cost analysis, deterministic) and their ratio to the
whole product's; min and median of N calls and their ratios to the whole arm's; the
largest difference from the whole product relative to max |X Xᵀ| (products), or the
polar error ‖O − U Vᵀ‖_F / ‖U Vᵀ‖_F against the float64 SVD (Newton–Schulz). The load
while each shape ran, and whether the machine was busy, follow its rows.

Compile-only shapes (`--flops-only`) give the compiled flops and HBM bytes accessed, on
the CPU, or on the offline TPU v5p compiler with the TPU defaults (`--platform tpu`,
where libtpu is installed), there with the roofline time of a v5p chip: the longer of
the flops at its bfloat16 peak and the bytes at its HBM bandwidth (`ROOFLINE`), and
with the Gram-space m×m products that a TPU forms whole cut too, in at most 8 and 4
block rows.

    python -m benchmarks.newton_schulz_symmetric [--reps 9] [--shapes 768x768,...]
    python -m benchmarks.newton_schulz_symmetric --shapes "" --platform tpu
    python -m benchmarks.newton_schulz_symmetric --shapes 16x48 --blocks 2 --reps 2 --flops-only 32x96
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections.abc import Sequence
from typing import Optional
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import muon_optax as mo
from benchmarks import common
from benchmarks.common import LoadWatch, header, min_median, parse_shapes, time_interleaved
from benchmarks.train_step import ROOFLINE
from muon_optax._newton_schulz import symmetric
from muon_optax._newton_schulz.operands import Matmul

GPT2 = "768x768,768x2304,768x3072,3072x768"
LLAMA = "4096x4096,4096x14336"
# The defaults; the standard iteration with the defaults' turbo (what a TPU ran before
# 16-bit Gram space); and Jordan's standard 5 steps.
NS_ARMS = {"defaults": mo.NewtonSchulz(), "turbo standard": mo.NewtonSchulz(gram=False),
           "jordan 5 standard": mo.NewtonSchulz("jordan", steps=5, gram=False)}


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--reps", type=int, default=9, help="timed calls per arm (N)")
  ap.add_argument("--shapes", default=GPT2, help="timed shapes, comma-separated ('' for none)")
  ap.add_argument("--blocks", default="2,3,4,6,8", help="block rows of X Xᵀ, comma-separated")
  ap.add_argument("--flops-only", default=LLAMA, help="shapes compiled only ('' for none)")
  ap.add_argument("--platform", choices=("cpu", "tpu"), default="cpu",
                  help="compile those for the CPU, or for a TPU v5p chip (libtpu)")
  return ap


@contextlib.contextmanager
def whole_products():
  """While tracing: every symmetric product computed whole, as before this module."""
  with mock.patch.object(symmetric, "MIN_BLOCK_ROWS", 1 << 62):
    yield


@contextlib.contextmanager
def cut_at_any_size():
  """While tracing: every product cut at any size, below a platform's floors too."""
  with (mock.patch.object(symmetric, "MIN_CUT_ROWS_ON", {}),
        mock.patch.object(symmetric, "MIN_SQUARE_CUT_WORK_ON", {}),
        mock.patch.object(symmetric, "MIN_GRAM_SPACE_X_XT_CUT_WORK_ON", {})):
    yield


@contextlib.contextmanager
def squares_whole(backend: str):
  """While tracing for `backend`: the standard iteration's products of two m×m matrices
  whole at any size, X Xᵀ cut as the library cuts it."""
  with mock.patch.object(symmetric, "MIN_SQUARE_CUT_WORK_ON", {backend: 1 << 62}):
    yield


def compiled(fn, x, traced_in, device=None):
  """fn jitted and compiled for x (a shape on `device` when given, traced as on its
  platform), traced in the context `traced_in()` (`whole_products`, `cut_at_any_size`,
  or `contextlib.nullcontext`: the library's products)."""
  with traced_in():
    if device is None:
      return jax.jit(fn).lower(x).compile()
    spec = jax.ShapeDtypeStruct(x.shape, x.dtype,
                                sharding=jax.sharding.SingleDeviceSharding(device))
    return common.traced_for(device.platform, fn, spec).lower().compile()


def flops(exe) -> float:
  return common.cost_analysis(exe)["flops"]


def roofline_ms(exe) -> float:
  """A v5p chip's time for the program by the roofline of its flops and HBM bytes
  (`ROOFLINE`: the longer of the two, as if each overlapped the other)."""
  hbm = common.cost_analysis(exe)["bytes accessed"]
  return 1e3 * max(flops(exe) / ROOFLINE["flops"], hbm / ROOFLINE["hbm"])


@contextlib.contextmanager
def gram_space_products_cut(blocks: int = symmetric.MAX_BLOCKS):
  """While tracing: the Gram-space iteration's products of two m×m matrices cut too
  (not whole, as on a TPU), and its X Xᵀ, every product in at most `blocks` block rows."""
  with (mock.patch.object(symmetric, "WHOLE_GRAM_SPACE_PRODUCTS_ON", ()),
        mock.patch.object(symmetric, "MAX_SQUARE_BLOCKS_ON", {}),
        mock.patch.object(symmetric, "MIN_SQUARE_CUT_WORK_ON", {}),
        mock.patch.object(symmetric, "MIN_GRAM_SPACE_X_XT_CUT_WORK_ON", {}),
        mock.patch.object(symmetric, "MAX_BLOCKS", blocks)):
    yield


LIBRARY = contextlib.nullcontext  # traced with the library's own products


def product_arms(blocks: Sequence[int]) -> dict[str, tuple]:
  """name -> (fn of x, the context it is traced in: see `compiled`)."""
  mm = Matmul(jnp.float32, jnp.float32, jax.lax.Precision.HIGHEST)
  arms = {"X Xᵀ whole": (lambda x: mm(x, x.T), LIBRARY)}
  for b in blocks:
    arms[f"X Xᵀ symmetric, {b} block rows"] = (
        lambda x, b=b: symmetric.symmetric_gram(x, mm, b), LIBRARY)
  return arms


def ns_arms(backend: Optional[str] = None) -> dict[str, tuple]:
  """name -> (fn of x, the context it is traced in), with the settings "auto" picks on
  `backend` (default: here); on a platform with floors (`MIN_CUT_ROWS_ON`,
  `MIN_SQUARE_CUT_WORK_ON`, `MIN_GRAM_SPACE_X_XT_CUT_WORK_ON`), every product cut below
  them too, and the standard iteration's m×m products whole at any size; on one that
  forms the Gram-space products of two m×m matrices whole
  (`WHOLE_GRAM_SPACE_PRODUCTS_ON`), those cut too, in at most `MAX_BLOCKS` and 4 block
  rows (Gram-space settings only)."""
  out = {}
  for name, settings in NS_ARMS.items():
    settings = settings if backend is None else settings.on(backend)
    # One function each: jax reuses a function's trace, made with whole products or not.
    out[f"newton_schulz {name}, whole products"] = (
        lambda x, s=settings: mo.newton_schulz(x, s), whole_products)
    out[f"newton_schulz {name}, symmetric"] = (
        lambda x, s=settings: mo.newton_schulz(x, s), LIBRARY)
    if backend in symmetric.MIN_CUT_ROWS_ON:
      out[f"newton_schulz {name}, cut at any size"] = (
          lambda x, s=settings: mo.newton_schulz(x, s), cut_at_any_size)
    if backend in symmetric.MIN_SQUARE_CUT_WORK_ON:
      out[f"newton_schulz {name}, squares whole"] = (
          lambda x, s=settings: mo.newton_schulz(x, s),
          functools.partial(squares_whole, backend))
    if backend in symmetric.WHOLE_GRAM_SPACE_PRODUCTS_ON and settings.gram is not False:
      for most in (symmetric.MAX_BLOCKS, 4):
        out[f"newton_schulz {name}, Gram-space products cut, at most {most} block rows"] = (
            lambda x, s=settings: mo.newton_schulz(x, s),
            functools.partial(gram_space_products_cut, most))
  return out


def polar_error(out, x) -> float:
  u, _, vt = np.linalg.svd(np.asarray(x, np.float64), full_matrices=False)
  polar = u @ vt
  return float(np.linalg.norm(np.asarray(out, np.float64) - polar) / np.linalg.norm(polar))


def timed_rows(shape, reps: int, blocks: Sequence[int]) -> None:
  x = jax.random.normal(jax.random.key(0), shape)
  label = "×".join(map(str, shape))
  for group in (product_arms(blocks), ns_arms()):
    exes = {name: compiled(fn, x, traced_in) for name, (fn, traced_in) in group.items()}
    with LoadWatch() as load:
      times = time_interleaved({name: (lambda e=e: e(x)) for name, e in exes.items()}, reps)
    outs = {name: e(x) for name, e in exes.items()}
    for name, exe in exes.items():
      base = name.replace("symmetric", "whole products") if "newton" in name else "X Xᵀ whole"
      if "newton" in name:
        acc = f"polar err {polar_error(outs[name], x):.4f}"
      else:
        ref = outs[base]
        acc = f"{float(jnp.max(jnp.abs(outs[name] - ref)) / jnp.max(jnp.abs(ref))):.1e}"
      lo, med = min_median(times[name])
      base_lo, base_med = min_median(times[base])
      print(f"| {label} | {name} | {flops(exe) / 1e9:.3f} | "
            f"{flops(exe) / flops(exes[base]):.3f} | {lo * 1e3:.2f} | {med * 1e3:.2f} | "
            f"{lo / base_lo:.2f}× | {med / base_med:.2f}× | {acc} |", flush=True)
    print(f"| {label} | {load.note()} | | | | | | | |", flush=True)


def flops_rows(shape, blocks: Sequence[int], platform: str) -> None:
  x = jax.ShapeDtypeStruct(shape, jnp.float32)
  label = "×".join(map(str, shape))
  if platform == "tpu":  # the offline compiler: no TPU needed, libtpu is
    chip = common.v5p_chip()
    group, name = ns_arms("tpu"), "tpu v5p"
  else:
    chip, group, name = None, {**product_arms(blocks), **ns_arms()}, "cpu"
  exes = {arm: compiled(fn, x, traced_in, chip) for arm, (fn, traced_in) in group.items()}
  for arm, exe in exes.items():
    base = (arm.split(", ", 1)[0] + ", whole products") if "newton" in arm else "X Xᵀ whole"
    hbm = common.cost_analysis(exe)["bytes accessed"]
    roofline = (f"{roofline_ms(exe):.2f} | {roofline_ms(exe) / roofline_ms(exes[base]):.3f}"
                if platform == "tpu" else "— | —")
    print(f"| {label} | {name} | {arm} | {flops(exe) / 1e9:.1f} | "
          f"{flops(exe) / flops(exes[base]):.3f} | {hbm / 1e9:.2f} | "
          f"{hbm / common.cost_analysis(exes[base])['bytes accessed']:.3f} | {roofline} |", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> None:
  args = parser().parse_args(argv)
  blocks = [int(b) for b in args.blocks.split(",")]
  print(header("benchmarks.newton_schulz_symmetric", argv))
  print(f"Gaussian float32 input; min and median of {args.reps} interleaved calls per arm; "
        f"default block rows: {symmetric.MIN_BLOCK_ROWS} rows or more, at most "
        f"{symmetric.MAX_BLOCKS}; X Xᵀ cut from {symmetric.MIN_CUT_ROWS_ON} rows on, products "
        f"of two m×m matrices from m²n {symmetric.MIN_SQUARE_CUT_WORK_ON} on, in at most "
        f"{symmetric.MAX_SQUARE_BLOCKS_ON} block rows; the Gram-space iteration's X Xᵀ "
        f"from m²n {symmetric.MIN_GRAM_SPACE_X_XT_CUT_WORK_ON} on\n")
  if args.shapes:
    print("| shape | arm | GFLOP (compiled) | / whole | min ms | median ms | min / whole | "
          "median / whole | accuracy |\n|---|---|--:|--:|--:|--:|--:|--:|---|")
    for shape in parse_shapes(args.shapes):
      timed_rows(shape, args.reps, blocks)
  if args.flops_only:
    print("\n| shape | compiled for | arm | GFLOP (compiled) | / whole | GB accessed | / whole | "
          "v5p roofline ms | / whole |\n|---|---|---|--:|--:|--:|--:|--:|--:|")
    for shape in parse_shapes(args.flops_only):
      flops_rows(shape, blocks, args.platform)


if __name__ == "__main__":
  main()
