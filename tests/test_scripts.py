"""Every benchmark and example runs, at its smallest configuration, and runs as documented:
the commands in the scripts' docstrings and in README.md parse, scripts import only
`benchmarks.*`, `workload.*` and `muon_optax`, and each is a module run from the
repository root (`python -m pytest` from there makes the packages importable).

Each script's docstring shows its smallest configuration, the one run here."""

import argparse
import ast
import importlib
import json
import pathlib
import re
import shlex
import subprocess
import sys
from typing import Optional
from unittest import mock

import numpy as np
import pytest
from _env import script_env

import muon_optax as mo
from workload import stdlib_text

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("benchmarks", "examples", "workload")
# Every script: a module of benchmarks/ or examples/ run with `python -m`.
SCRIPTS = sorted(f"{package}.{path.stem}" for package in ("benchmarks", "examples")
                 for path in (ROOT / package).glob("*.py")
                 if path.stem not in ("__init__", "common"))
# A real but small corner of the standard library keeps data loading quick.
DATA = str(stdlib_text.stdlib_root() / "email")


def smallest(module: str, tmp: pathlib.Path) -> Optional[list[str]]:
  """The smallest command line of each script (as in its docstring); None for the
  scripts with tests of their own and for benchmarks.hlo, which reads files."""
  return {
      "benchmarks.accelerator": ["--shapes", "2x16x48", "--layers", "1", "--d", "32",
                                 "--vocab", "64", "--reps", "2", "--peak-n", "64"],
      "benchmarks.adam_backends": ["--tensors", "4", "--size", "64", "--warmup", "1",
                                   "--steps", "3"],
      "benchmarks.distributed": ["--layers", "1", "--d", "64", "--vocab", "256",
                                 "--devices", "1", "2", "--peaks", "zero1"],
      "benchmarks.scale": ["--model", "8b", "--layers", "2", "--devices", "8", "--out",
                           str(tmp / "s.jsonl")],
      "benchmarks.e2e_loss": ["--preset", "tiny", "--steps", "3", "--data-root", DATA,
                              "--out", str(tmp / "loss.png")],
      "benchmarks.fused_qkv": ["--steps", "20", "--seeds", "0", "--lrs", "0.04", "--data-root",
                               DATA, "--out-dir", str(tmp)],
      "benchmarks.infer_routing": ["--layers", "1", "--d-model", "32", "--heads", "2",
                                   "--vocab", "64", "--seq-len", "16", "--repeats", "1"],
      "benchmarks.newton_schulz": ["--shapes", "2x16x48", "--reps", "2", "--peak-n", "64"],
      "benchmarks.newton_schulz_criterion": ["--shapes", "16x48"],
      "benchmarks.newton_schulz_symmetric": ["--shapes", "16x48", "--blocks", "2", "--reps",
                                             "2", "--flops-only", "32x96"],
      "benchmarks.newton_schulz_gram": ["--shapes", "16x48", "--dtypes", "float32", "--m",
                                        "16", "--aspects", "3", "--reps", "2"],
      "benchmarks.newton_schulz_precision": ["--count", "3", "--shapes", "16x48", "--presets",
                                             "turbo,cubic5", "--classes", "gaussian,heavy",
                                             "--llama", "16x48", "--reps", "2", "--out",
                                             str(tmp / "p.jsonl")],
      "benchmarks.optimizer_step": ["--layers", "1", "--d", "32", "--vocab", "64", "--ctx",
                                    "8", "--steps", "2"],
      "examples.qk_clip": ["--steps", "2", "--batch", "2", "--seq-len", "16", "--d-model",
                           "16", "--heads", "2", "--layers", "1", "--data-root", DATA,
                           "--out-dir", str(tmp)],
      "examples.sharded_training": ["--devices", "2", "--steps", "2", "--batch", "4",
                                    "--seq-len", "16", "--d-model", "32", "--layers", "1",
                                    "--heads", "2", "--data-root", DATA],
  }.get(module)


def run_module(module: str, argv: list[str], timeout: float = 240) -> str:
  """`python -m module *argv` from the repository root, as a user runs it; its stdout."""
  done = subprocess.run([sys.executable, "-m", module, *argv], cwd=ROOT, env=script_env(),
                        capture_output=True, text=True, timeout=timeout)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


def check_report(out: str, module: str, argv: list[str]) -> None:
  """The report starts with the command that reproduces it and the machine."""
  command, machine = out.splitlines()[:2]
  assert command == f"# python -m {module} {' '.join(argv)}"
  assert machine.startswith("machine: ")


def assert_timed(out: str) -> None:
  """Times come as min and median, with the load on the machine while they ran."""
  assert "min" in out and "median" in out
  assert "load average" in out and ("BUSY" in out or "otherwise idle" in out)


# --- each script at its smallest configuration --------------------------------------


def test_optimizer_step_times_every_arm(tmp_path, capsys):
  argv = smallest("benchmarks.optimizer_step", tmp_path)
  from benchmarks import optimizer_step
  [times] = optimizer_step.main(argv).values()
  assert list(times) == ["muon_optax.muon (defaults)", "muon_optax.muon jordan 5",
                         "muon_optax.muon jordan 5 gram=False", "muon_optax.normuon",
                         "muon_optax.adamuon", "muon_optax.muon scale='adaptive'",
                         "muon_optax.muon qkv split in 3", "muon_optax.nordion2 (fraction 0.25)",
                         "muon_optax.muonbp (8 blocks, period 4)", "muon_optax.muonh",
                         "optax.contrib.muon", "optax.adamw"]
  assert all(len(t) == 2 and min(t) > 0 for t in times.values())
  out = capsys.readouterr().out
  check_report(out, "benchmarks.optimizer_step", argv)
  assert_timed(out)
  assert "| optax.contrib.muon | " in out and "state B/param (Muon kernels)" in out
  assert out.count("| mlp/fc ") == 1  # the polar-error table


def test_fused_qkv_trains_the_kernel_both_ways(tmp_path, capsys):
  argv = smallest("benchmarks.fused_qkv", tmp_path)
  from benchmarks import fused_qkv
  rows = fused_qkv.main(argv)
  assert list(rows) == ["qkv split in 3", "qkv as one matrix"]
  # Three 64×64 standard iterations against one 64×192 Gram-space one: not the same work.
  assert rows["qkv split in 3"]["ns_flops"] != rows["qkv as one matrix"]["ns_flops"]
  out = capsys.readouterr().out
  check_report(out, "benchmarks.fused_qkv", argv)
  assert (tmp_path / "runs.jsonl").exists()
  again = fused_qkv.main(argv)  # every run is on disk: nothing runs again
  assert capsys.readouterr().out.count("(on disk)") == 2 and again.keys() == rows.keys()


def test_accelerator_runs_the_table_and_the_full_update(tmp_path, capsys):
  argv = smallest("benchmarks.accelerator", tmp_path)
  from benchmarks import accelerator
  accelerator.main(argv)
  out = capsys.readouterr().out
  check_report(out, "benchmarks.accelerator", argv)
  assert_timed(out)
  assert out.count("| 2×16×48 | ") == 13  # 12 muon_optax arms and optax.contrib's
  assert "| muon_optax.adamuon | " in out and "| optax.contrib.muon | " in out


def test_newton_schulz_times_every_arm(tmp_path, capsys):
  argv = smallest("benchmarks.newton_schulz", tmp_path)
  from benchmarks import newton_schulz
  newton_schulz.main(argv)
  out = capsys.readouterr().out
  check_report(out, "benchmarks.newton_schulz", argv)
  assert_timed(out)
  assert out.count("| 2×16×48 | ") == 12 + 2 + 1  # ours, optax's, the peak


def test_optimizer_step_times_chosen_arms_against_the_reference(tmp_path, capsys):
  argv = smallest("benchmarks.optimizer_step", tmp_path) + ["--arms", "muon_optax.muon (defaults)"]
  from benchmarks import optimizer_step
  [times] = optimizer_step.main(argv).values()
  assert list(times) == ["muon_optax.muon (defaults)", "optax.contrib.muon"]
  assert_timed(capsys.readouterr().out)


def test_newton_schulz_symmetric_times_and_counts_every_arm(tmp_path, capsys):
  argv = smallest("benchmarks.newton_schulz_symmetric", tmp_path)
  from benchmarks import newton_schulz_symmetric
  newton_schulz_symmetric.main(argv)
  out = capsys.readouterr().out
  check_report(out, "benchmarks.newton_schulz_symmetric", argv)
  assert_timed(out)
  # X Xᵀ whole and in 2 block rows, 2 loads, 2 Newton–Schulz arms per setting; then
  # flops alone.
  ns_arms = 2 * len(newton_schulz_symmetric.NS_ARMS)
  assert out.count("| 16×48 | ") == 2 + 2 + ns_arms
  assert out.count("| 32×96 | cpu | ") == 2 + ns_arms


def test_newton_schulz_criterion_compares_every_arm(tmp_path, capsys):
  argv = smallest("benchmarks.newton_schulz_criterion", tmp_path)
  from benchmarks import newton_schulz_criterion
  newton_schulz_criterion.main(argv)
  out = capsys.readouterr().out
  check_report(out, "benchmarks.newton_schulz_criterion", argv)
  rows = [line for line in out.splitlines() if line.startswith("| 16×48 |")]
  assert len(rows) == 2 * len(newton_schulz_criterion.ARMS)
  assert rows[0].split(" | ")[4:6] == ["1.000", "1.000"]  # the baseline against itself


def test_newton_schulz_gram_forces_restarts_and_times_the_crossover(tmp_path, capsys):
  argv = smallest("benchmarks.newton_schulz_gram", tmp_path)
  from benchmarks import newton_schulz_gram
  newton_schulz_gram.main(argv)
  out = capsys.readouterr().out
  check_report(out, "benchmarks.newton_schulz_gram", argv)
  assert_timed(out)
  f64_err = {line.split(" | ")[4]: float(line.split(" | ")[5]) for line in out.splitlines()
             if "| gaussian | turbo | float32 |" in line}
  # Forced restarts take effect: the state rebuilt or not, the rounding differs. (With
  # 32-bit operands Q is carried whole and each state matrix is one product, and on this
  # small case one restart no longer shows the gain it has with 16-bit operands.)
  assert f64_err["gram ()"] != f64_err["gram (2,)"]
  # turbo's 4 steps run as one segment in float32 (`gram_restarts`).
  assert f64_err["gram (auto) ()"] == f64_err["gram ()"]
  assert "| 16×48 | 3 |" in out


def test_newton_schulz_precision_fills_every_cell_and_resumes(tmp_path, capsys):
  argv = smallest("benchmarks.newton_schulz_precision", tmp_path)
  from benchmarks import newton_schulz_precision as bench
  for mode in ("accuracy", "exchange", "flops", "time"):
    bench.main([*argv, "--mode", mode])
  out = capsys.readouterr().out
  check_report(out, "benchmarks.newton_schulz_precision", [*argv, "--mode", "accuracy"])
  assert_timed(out)
  rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
  # 2 presets × (3 precisions × 2 variants + fp8's standard) = 14 cells, per class,
  # per mode.
  kinds = [r["key"].split()[0] for r in rows]
  assert kinds.count("accuracy") == 2 * 14 and kinds.count("flops") == kinds.count("time") == 14
  # The exchange mode: 2 classes × 2 presets × 3 ways to move the matrices; rounding
  # them or their results changes the figures.
  wired = {r["key"]: r["err_mean"] for r in rows if r["key"].startswith("exchange")}
  assert len(wired) == 12
  assert all(wired[k] != wired[k.replace("float32", other)] for k in wired
             if k.endswith(" float32") for other in ("back-bfloat16", "bfloat16"))
  assert all(r["err_max"] >= r["err_mean"] > 0 for r in rows if "err_mean" in r)
  # Resumable: a second run adds nothing.
  bench.main([*argv, "--mode", "accuracy"])
  assert len((tmp_path / "p.jsonl").read_text().splitlines()) == len(rows)


def test_newton_schulz_precision_counts_diverged_matrices_apart():
  from benchmarks.newton_schulz_precision import measure, polar_of
  x = np.random.default_rng(0).standard_normal((3, 8, 24))
  polar = polar_of(x)
  x[1, 0, 0] = np.inf  # its iteration overflows
  row = measure(x, polar, mo.NewtonSchulz("jordan"))
  assert row["diverged"] == 1
  kept = measure(x[[0, 2]], polar[[0, 2]], mo.NewtonSchulz("jordan"))
  assert row == {**kept, "diverged": 1}


def test_adam_backends_times_every_backend(tmp_path, capsys):
  argv = smallest("benchmarks.adam_backends", tmp_path)
  from benchmarks import adam_backends
  times = adam_backends.main(argv)
  assert list(times) == ["optax.adamw"] + [f"mo.AuxAdam(backend={b!r})"
                                           for b in ("optax", "offload", "reference")]
  out = capsys.readouterr().out
  check_report(out, "benchmarks.adam_backends", argv)
  assert_timed(out)


def test_infer_routing_routes_both_variants(tmp_path, capsys):
  argv = smallest("benchmarks.infer_routing", tmp_path)
  from benchmarks import infer_routing
  times = infer_routing.main(argv)
  assert {k: len(v) for k, v in times.items()} == {False: 1, True: 1}
  out = capsys.readouterr().out
  check_report(out, "benchmarks.infer_routing", argv)
  assert "6 muon / 15 adam leaves" in out and "6 muon / 14 adam leaves" in out


def test_distributed_compiles_both_layouts(tmp_path, capsys):
  argv = smallest("benchmarks.distributed", tmp_path)
  from benchmarks import distributed
  from benchmarks.common import LAYOUTS
  distributed.main(argv)
  out = capsys.readouterr().out
  check_report(out, "benchmarks.distributed", argv)
  # Fixed columns: layout, devices, the arm's name in 22 characters, then the figures.
  first, _, layouts = out.partition("\nmo.muon in each layout")
  rows = [(*line[:10].split(), line[11:33].strip(), line[33:].split())
          for line in first.splitlines() if line.startswith(("zero1", "fsdp"))]
  arms = ("muon_optax", "muon_optax flops alone", "nordion2 (0.25)", "nordion2 per shard",
          "muonbp full step", "muonbp block step", "optax.contrib.muon")
  assert [r[:3] for r in rows] == [(kind, n, name) for kind in ("zero1", "fsdp")
                                   for n in ("1", "2") for name in arms]
  collectives = {(kind, n, name): int(figures[2]) for kind, n, name, figures in rows}
  assert collectives["fsdp", "2", "muonbp block step"] == 0  # no communication at all
  assert collectives["fsdp", "2", "muonbp full step"] == collectives["fsdp", "2", "muon_optax"]
  layouts, _, peaks = layouts.partition("\nUpdate and apply in one program")
  # The peaks' table: AdamW's and Muon's step in the layout asked, each peak at least
  # its temp.
  rows = {line[9:31].strip(): [float(v) for v in line[31:].split()]
          for line in peaks.splitlines() if line.startswith("zero1")}
  assert list(rows) == ["optax.adamw", "mo.muon", "mo.muon, exchanges=4"]
  assert all(peak >= temp > 0 for peak, temp in rows.values())
  # The layouts' table: each layout, mesh and way of telling it; only a bare mesh= on an
  # Auto mesh guesses (and warns), and a stated layout costs no more than on Explicit axes.
  table = {(line[:8].strip(), line[9:17].strip(), line[18:37].strip()): line[37:].split()
           for line in layouts.splitlines() if line.startswith(LAYOUTS)}
  forms = ("stated", "stated, 1 exchange", "bare mesh=")
  assert list(table) == [(k, t, f) for k in LAYOUTS for t in ("Auto", "Explicit") for f in forms]
  for (kind, types, form), (count, _, temp, warned, *_) in table.items():
    assert warned == ("yes" if (types, form) == ("Auto", "bare mesh=") else "no")
    if form != "bare mesh=":
      assert int(count) <= int(table[kind, "Explicit", form][0])
    if form == "stated":  # exchanges by need hold less than one exchange, or the same
      assert float(temp) <= float(table[kind, types, "stated, 1 exchange"][2])


def test_scale_compiles_each_arm_once_and_resumes(tmp_path):
  # The smallest case: 2 layers of Llama-3-8B shapes on 8 simulated devices, FSDP and
  # ZeRO-1, every arm; in a process of its own, as the devices must be set before jax.
  argv = smallest("benchmarks.scale", tmp_path)
  out = run_module("benchmarks.scale", argv, timeout=480)
  check_report(out, "benchmarks.scale", argv)
  rows = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
  assert [(r["layout"], r["arm"]) for r in rows] == [
      (layout, arm) for layout in ("fsdp", "zero1")
      for arm in ("muon_optax", "optax.contrib.muon", "optax.adamw")]
  ours = rows[0]
  assert "error" not in ours
  # Packed, not one per matrix (28 for these 14): per exchange, the default
  # MeshLayout.exchanges of them, one all-to-all in and one out, and as many again among
  # the devices of a residue for column parts cut from whole blocks (a split leftover).
  from muon_optax._placement.mesh_layout import EXCHANGES
  assert 2 <= ours["collectives"]["all-to-all"][0] <= 4 * EXCHANGES
  assert ours["flops"] <= 1.6 * ours["ideal_flops"]  # 14 matrices of 3 shapes for 8 devices
  again = run_module("benchmarks.scale", argv, timeout=120)  # all rows on disk: none redone
  assert len((tmp_path / "s.jsonl").read_text().splitlines()) == len(rows)
  assert "muon_optax" not in again.split("----\n", 1)[-1]


def test_scale_plan_table_weighs_bytes_or_flops_alone():
  # The planner's table, no compile: for each backend's defaults, the plan that weighs
  # split traffic too and the one that weighs flops alone, which is never further from
  # the ideal. With the GPU's 16-bit operands a split saves fewer flop-seconds against
  # the same traffic: at 1024 devices the weighed plan leaves some devices idle.
  from benchmarks.scale import plan_table
  lines = plan_table([64, 1024], ["8b"]).splitlines()
  cells = {tuple(line[:27].split(maxsplit=2)): [float(c) for c in line[27:].split()]
           for line in lines[1:]}
  assert set(cells) == {("8b", d, w) for d in ("cpu", "gpu") for w in ("flops, bytes",
                                                                       "flops alone")}
  for defaults in ("cpu", "gpu"):
    weighed, alone = cells["8b", defaults, "flops, bytes"], cells["8b", defaults, "flops alone"]
    assert all(1.0 <= a <= w for a, w in zip(alone, weighed))
  assert cells["8b", "gpu", "flops alone"][1] < cells["8b", "gpu", "flops, bytes"][1]


def test_hlo_counts_the_collectives_of_a_saved_program(tmp_path):
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:2])
  x = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, P("data")))
  program = jax.jit(lambda x: x.sum(0), out_shardings=NamedSharding(mesh, P())).lower(x)
  path = tmp_path / "program.txt"
  path.write_text(program.compile().as_text())
  out = run_module("benchmarks.hlo", [str(path)], timeout=60)
  assert f"| {path} | 0, 0 | 1, " in out  # one all-reduce


@pytest.mark.slow  # end-to-end training
def test_e2e_loss_backends_give_the_same_losses(tmp_path, capsys):
  argv = smallest("benchmarks.e2e_loss", tmp_path)
  from benchmarks import e2e_loss
  curves = e2e_loss.main(argv)
  reference = next(iter(curves.values()))
  assert len(curves) == 4 and all(len(c) == 3 for c in curves.values())
  assert all(abs(c - reference).max() < 1e-4 for c in curves.values())
  check_report(capsys.readouterr().out, "benchmarks.e2e_loss", argv)
  assert (tmp_path / "loss.png").stat().st_size > 0


@pytest.mark.slow  # end-to-end training
def test_convergence_sweeps_trains_and_times(tmp_path, capsys):
  convergence = importlib.import_module("benchmarks.convergence")
  summary = convergence.main([
      "--steps", "4", "--d-model", "16", "--layers", "1", "--heads", "2", "--seq-len", "16",
      "--batch", "4", "--eval-every", "2", "--eval-batches", "1", "--seeds", "0",
      "--optimizers", "adamw", "muon", "--adamw-lrs", "3e-3", "--muon-lrs", "0.02",
      "--extend", "0", "--presets", "--time-reps", "2", "--data-root", DATA,
      "--out-dir", str(tmp_path)])
  assert summary["best_rates"] == {"adamw": 3e-3, "muon": 0.02}
  assert {k: len(v) for k, v in summary["step_times_s"].items()} == {"adamw": 2, "muon": 2}
  assert_timed(capsys.readouterr().out)
  assert (tmp_path / "convergence.json").stat().st_size > 0


def test_qk_clip_trains_both_runs(tmp_path):
  from examples import qk_clip
  runs = qk_clip.main(smallest("examples.qk_clip", tmp_path))
  assert list(runs) == ["Muon", "MuonClip"]
  assert all(len(losses) == 2 for losses, _, _ in runs.values())
  assert (tmp_path / "qk_clip.png").stat().st_size > 0


def test_sharded_training_sets_up_its_devices_and_trains_both_layouts(tmp_path):
  """Run as a user runs it: the script sets XLA_FLAGS for --devices before importing jax."""
  out = run_module("examples.sharded_training", smallest("examples.sharded_training", tmp_path))
  assert "2 simulated devices, mesh {'data': 2}" in out
  assert [line.split()[0] for line in out.splitlines()
          if line.startswith(("zero1", "fsdp"))] == ["zero1", "fsdp"]


# --- runs as documented ----------------------------------------------------------------


def documented_commands(text: str) -> list[tuple[str, list[str]]]:
  """(module, argv) of every `python -m benchmarks.x ...` / `examples.x` in a text, with
  line continuations joined, comments dropped and optional-flag brackets removed."""
  text = text.replace("\\\n", " ")
  commands = []
  for match in re.finditer(r"python -m\s+((?:benchmarks|examples)\.\w+)([^`\n#&]*)", text):
    argv = shlex.split(match.group(2).replace("[", " ").replace("]", " "))
    commands.append((match.group(1), [a for a in argv if a not in ("...", "…")]))
  return commands


def parses(module: str, argv: list[str]) -> None:
  """The script's own command line accepts argv: its main runs up to the parsing only."""

  class Parsed(Exception):
    pass

  parse_args = argparse.ArgumentParser.parse_args

  def parse_then_stop(self, args=None, namespace=None):
    parse_args(self, args, namespace)  # exits on a flag it does not know
    raise Parsed

  with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop):
    with pytest.raises(Parsed):
      importlib.import_module(module).main(argv)


def without_paths(argv: list[str]) -> list[str]:
  """argv with the values of path flags blanked: docstrings show DIR, tests a tmp path."""
  return ["…" if i and argv[i - 1] in ("--data-root", "--out", "--out-dir") else a
          for i, a in enumerate(argv)]


@pytest.mark.parametrize("module", SCRIPTS)
def test_docstring_commands_parse_and_show_the_smallest(module, tmp_path):
  source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
  commands = documented_commands(ast.get_docstring(ast.parse(source)) or "")
  assert commands, f"{module}: no `python -m {module}` in its docstring"
  for name, argv in commands:
    assert name == module, f"{module}'s docstring documents {name}"
    parses(module, argv)
  if (argv := smallest(module, tmp_path)) is not None:
    assert without_paths(argv) in [without_paths(a) for _, a in commands]


def test_readme_commands_parse():
  pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
  commands = [c for page in pages for c in documented_commands(page.read_text())]
  assert commands
  for module, argv in commands:
    assert module in SCRIPTS, f"the README or a docs page runs {module}, which is no script"
    parses(module, argv)


# The scripts tested on a tiny configuration in files of their own.
ELSEWHERE = {"benchmarks.checkpoint_io": "test_checkpoint_benchmark.py",
             "benchmarks.train_step": "test_train_step.py",
             "examples.train_gpt": "test_train_gpt.py"}


def test_every_script_has_a_smallest_test():
  here = pathlib.Path(__file__).read_text().split("\nELSEWHERE = ")[0]
  for module in SCRIPTS:
    package, _, name = module.partition(".")
    tested = (ROOT / "tests" / ELSEWHERE[module]).read_text() if module in ELSEWHERE else here
    assert f'"{module}"' in tested or f"from {package} import {name}" in tested, module


def test_scripts_are_modules_that_import_only_the_project_packages():
  """No sys.path edits, no sibling modules imported by bare name; benchmarks never
  import examples, and neither examples nor workload import benchmarks."""
  siblings = {path.stem for package in PACKAGES for path in (ROOT / package).glob("*.py")}
  forbidden = {"benchmarks": {"examples"}, "examples": {"benchmarks"},
               "workload": {"benchmarks", "examples"}}
  for package in PACKAGES:
    for path in (ROOT / package).glob("*.py"):
      source = path.read_text()
      assert "sys.path" not in source, path
      if path.stem not in ("__init__", "common") and package != "workload":
        assert re.search(r'\nif __name__ == "__main__":\n  main\(\)\n$', source), path
      for node in ast.walk(ast.parse(source)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        for name in names:
          top = name.split(".")[0]
          assert top not in siblings - set(PACKAGES), f"{path}: import {name}"
          assert top not in forbidden[package], f"{path}: import {name}"


def test_convergence_times_alone_and_its_presets_at_their_own_rates(tmp_path, capsys):
  convergence = importlib.import_module("benchmarks.convergence")
  tiny = ["--steps", "2", "--d-model", "16", "--layers", "1", "--heads", "2", "--seq-len", "16",
          "--batch", "4", "--eval-every", "1", "--eval-batches", "1", "--time-reps", "2",
          "--data-root", DATA, "--out-dir", str(tmp_path)]
  times = convergence.main(tiny + ["--times-only", "--optimizers", "muon", "normuon"])
  assert {k: len(v) for k, v in times["step_times_s"].items()} == {"muon": 2, "normuon": 2}
  assert_timed(capsys.readouterr().out)
  summary = convergence.main(tiny + [
      "--seeds", "0", "--optimizers", "adamw", "muon", "--adamw-lrs", "3e-3",
      "--muon-lrs", "0.02", "--extend", "0", "--presets", "jordan",
      "--preset-factors", "0.5", "1"])
  presets = {r["label"]: r["lr"] for r in summary["rows"] if "ns=" in r["label"]}
  assert set(presets) == {"muon ns=turbo", "muon ns=jordan"}
  assert set(presets.values()) <= {0.01, 0.02}
