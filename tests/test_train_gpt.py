"""The main example end to end on a tiny config, the workload's GPT, and its
standard-library data loader. Run from the repository root (`python -m pytest`), which
makes `examples` and `workload` importable."""

import json
import pathlib

import numpy as np
import pytest

import muon_optax as mo
from examples import train_gpt
from workload import stdlib_text
from workload.train import steps_to_reach

pytestmark = pytest.mark.slow  # deselect with -m 'not slow'

# A real but small corner of the standard library keeps the data loading quick.
TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "32",
        "--batch", "8", "--eval-batches", "2", "--no-progress",
        "--data-root", str(stdlib_text.stdlib_root() / "email")]


def _write_tree(root: pathlib.Path, n: int) -> None:
  for i in range(n):
    path = root / f"pkg{i % 3}" / f"mod_{i}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"def f_{i}(x):\n    return x + {i}\n" * 20)
  (root / "__pycache__").mkdir()
  (root / "__pycache__" / "skipped.py").write_text("not source\n")
  (root / "notes.txt").write_text("not python\n")


def test_train_gpt_compares_muon_and_adamw_on_the_same_data(tmp_path, capsys):
  """The default run trains both optimizers from the same init on the same batches."""
  result = train_gpt.main(TINY + ["--steps", "12", "--eval-every", "6",
                                  "--out-dir", str(tmp_path)])
  muon, adamw = result["runs"]
  assert (muon["optimizer"], adamw["optimizer"]) == ("muon", "adamw")
  # Same init, same first batch: the loss before any update is the same program's output.
  assert muon["train_loss"][0] == adamw["train_loss"][0]
  for record in (muon, adamw):
    losses = record["train_loss"]
    assert len(losses) == 12 and np.all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < losses[0] - 0.5, losses
    assert record["val_loss"][-1][1] < record["val_loss"][0][1]
  assert (tmp_path / "loss.png").stat().st_size > 0
  saved = json.loads((tmp_path / "run.json").read_text())
  assert [r["optimizer"] for r in saved["runs"]] == ["muon", "adamw"]
  assert saved["runs"][1]["final_val_loss"] == pytest.approx(adamw["val_loss"][-1][1])
  out = capsys.readouterr().out
  assert "final val loss: muon" in out and out.count("\nmuon ") + out.count("\nadamw ") >= 2


@pytest.mark.parametrize("optimizer", ["adamw", "normuon", "adamuon", "adaptive"])
def test_train_gpt_optimizer_flag_runs_one(tmp_path, optimizer):
  result = train_gpt.main(TINY + ["--optimizer", optimizer, "--steps", "4", "--eval-every", "2",
                                  "--ns", "jordan", "--out-dir", str(tmp_path)])
  [run] = result["runs"]
  assert run["optimizer"] == optimizer and np.all(np.isfinite(run["train_loss"]))
  assert run["val_loss"][-1][1] < run["val_loss"][0][1] + 0.1
  assert len(json.loads((tmp_path / "run.json").read_text())["runs"]) == 1


def test_every_rate_flag_acts_or_names_the_one_to_use(capsys):
  # An AdamW-only run has no hidden-matrix rate: --lr would do nothing, so it is an error.
  with pytest.raises(SystemExit):
    train_gpt.parse_args(["--optimizer", "adamw", "--lr", "1e-3"])
  err = capsys.readouterr().err
  assert "--lr is the hidden matrices' rate" in err and "--adam-lr" in err
  cfg, _ = train_gpt.parse_args(["--optimizer", "adamw", "--adam-lr", "1e-3"])
  assert cfg.peak_lr == 1e-3
  cfg, _ = train_gpt.parse_args(["--lr", "0.01"])  # Muon's run; AdamW's keeps --adam-lr
  assert cfg.peak_lr == 0.01


def test_steps_to_reach_interpolates_between_evaluations():
  curve = [(10, 3.0), (20, 2.0), (30, 1.0)]
  assert steps_to_reach(curve, 1.5) == 25.0
  assert steps_to_reach(curve, 3.5) == 10.0
  assert steps_to_reach(curve, 0.5) is None


def test_train_gpt_data_parallel_matches_one_device(tmp_path):
  """--devices 2 shards the batch over a "data" mesh; the maths must not change."""
  args = TINY + ["--optimizer", "muon", "--steps", "3", "--eval-every", "3"]
  one = train_gpt.main(args + ["--out-dir", str(tmp_path / "one")])["runs"][0]
  two = train_gpt.main(args + ["--devices", "2", "--out-dir", str(tmp_path / "two")])["runs"][0]
  np.testing.assert_allclose(two["train_loss"], one["train_loss"], rtol=1e-5, atol=1e-5)


def test_train_gpt_resume_matches_the_uninterrupted_run(tmp_path):
  """--checkpoint-dir saves every --eval-every steps; --resume continues from the latest."""
  import shutil

  args = TINY + ["--optimizer", "muon", "--steps", "4", "--eval-every", "2",
                 "--checkpoint-dir", str(tmp_path / "ckpt")]
  full = train_gpt.main(args + ["--out-dir", str(tmp_path / "full")])["runs"][0]
  # As if stopped between the saves of steps 2 and 4 (one subdirectory per optimizer).
  shutil.rmtree(tmp_path / "ckpt" / "muon" / "4")
  resumed = train_gpt.main(args + ["--resume", "--out-dir", str(tmp_path / "resumed")])["runs"][0]
  assert resumed["start_step"] == 2
  assert resumed["train_loss"] == full["train_loss"][2:]  # same program, same data: bit-exact
  assert resumed["val_loss"] == full["val_loss"][1:]


def test_clip_attention_gpt_has_the_same_params_and_sows_max_logits():
  """`attention="clip"` (examples/qk_clip.py) changes only what the attention sows."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  import muon_optax as mo
  from workload.gpt import GPT, GPTConfig

  cfg = GPTConfig(d_model=32, layers=2, heads=2, seq_len=16)
  plain, clip = (GPT(GPTConfig(**{**cfg.__dict__, "attention": a}), rngs=nnx.Rngs(0))
                 for a in ("mha", "clip"))
  p_plain, p_clip = (nnx.state(m, nnx.Param) for m in (plain, clip))
  assert jax.tree.structure(p_plain) == jax.tree.structure(p_clip)
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
  logits, inter = nnx.capture(clip, nnx.Intermediate)(tokens)
  # Same weights, same causal attention through another attention_fn: the same logits
  # up to float32 rounding of a differently ordered softmax (~100 ulps of O(1) values).
  np.testing.assert_allclose(logits, plain(tokens), rtol=1e-5, atol=1e-5)
  sown = mo.nnx.max_logits(inter)
  assert sorted(sown) == ["blocks/0/attn", "blocks/1/attn"]
  assert all(s.shape == (2,) and jnp.all(jnp.isfinite(s)) for s in sown.values())


def test_gpt_routing_sends_embeddings_and_head_to_adam():
  import jax
  from flax import nnx

  import muon_optax as mo
  from workload.gpt import GPT, GPTConfig

  for tie in (False, True):
    model = GPT(GPTConfig(d_model=32, layers=1, heads=2, seq_len=16, tie_embeddings=tie),
                rngs=nnx.Rngs(0))
    flat = jax.tree_util.tree_flatten_with_path(mo.label_params(nnx.state(model, nnx.Param)))[0]
    labels = {"/".join(str(k.key) for k in path if hasattr(k, "key")): label
              for path, label in flat}
    assert labels["embed/embedding"] == labels["pos_embed/embedding"] == "adam"
    assert labels.get("lm_head/kernel", "adam") == "adam"
    assert ("lm_head/kernel" in labels) != tie
    for name in ("attn/query/kernel", "attn/out/kernel", "mlp_in/kernel", "mlp_out/kernel"):
      assert labels[f"blocks/0/{name}"] == "muon", name
    assert labels["blocks/0/ln1/scale"] == labels["blocks/0/attn/query/bias"] == "adam"


def test_split_is_deterministic_and_disjoint(tmp_path):
  _write_tree(tmp_path, 60)
  train1, val1 = stdlib_text.load_splits(tmp_path, val_percent=20)
  train2, val2 = stdlib_text.load_splits(tmp_path, val_percent=20)
  assert train1.files == train2.files and val1.files == val2.files
  np.testing.assert_array_equal(train1.data, train2.data)
  assert not set(train1.files) & set(val1.files)
  assert sorted(train1.files + val1.files) == stdlib_text.source_files(tmp_path)
  assert len(train1.files + val1.files) == 60  # __pycache__ and .txt files skipped


def test_stdlib_split_has_no_overlap():
  files = stdlib_text.source_files()
  val = {f for f in files if stdlib_text.is_validation(f, 10)}
  train = set(files) - val
  assert train and val and not train & val
  assert 0.05 < len(val) / len(files) < 0.15


def test_split_does_not_depend_on_root_location(tmp_path):
  _write_tree(tmp_path / "a", 30)
  _write_tree(tmp_path / "elsewhere" / "b", 30)
  assert (stdlib_text.load_splits(tmp_path / "a", val_percent=30)[1].files
          == stdlib_text.load_splits(tmp_path / "elsewhere" / "b", val_percent=30)[1].files)


def test_empty_root_is_a_clear_error(tmp_path):
  (tmp_path / "only.txt").write_text("no python here\n")
  with pytest.raises(FileNotFoundError, match=r"no \.py source files found under"):
    stdlib_text.load_splits(tmp_path)


def test_batches_same_seed_same_data_and_resumable():
  data = np.arange(10_000, dtype=np.uint16).astype(np.uint8)
  a = stdlib_text.batches(data, 4, 16, seed=3)
  b = stdlib_text.batches(data, 4, 16, seed=3)
  first = [next(a) for _ in range(5)]
  for x in first:
    np.testing.assert_array_equal(x, next(b))
  assert first[0].shape == (4, 17) and first[0].dtype == np.int32
  resumed = stdlib_text.batches(data, 4, 16, seed=3, start_step=3)
  np.testing.assert_array_equal(next(resumed), first[3])
  assert not np.array_equal(next(stdlib_text.batches(data, 4, 16, seed=4)), first[0])


def _updates(tx, params, steps=3):
  """The updates of `steps` steps of `tx` on fixed pseudo-gradients."""
  import jax
  import optax

  state, out = tx.init(params), []
  for i in range(steps):
    grads = jax.tree.map(lambda p: jax.numpy.cos(3.0 * p + i), params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    out.append(updates)
  return out


@pytest.mark.parametrize("optimizer, cautious", [("muon-wd", False), ("normuon-cwd", True)])
def test_weight_decay_flag_sets_the_decay_presets_decay(optimizer, cautious):
  """A -wd / -cwd preset decays by 0.1 unless --weight-decay says otherwise; the record
  holds the decay that acts."""
  import jax
  import optax
  from flax import nnx

  import muon_optax as mo
  from workload.train import FAMILY, lr_schedule, make_model, make_optimizer, routing_of

  cfg, _ = train_gpt.parse_args(TINY + ["--optimizer", optimizer, "--weight-decay", "0.05"])
  assert cfg.resolved().weight_decay == 0.05
  assert train_gpt.parse_args(TINY + ["--optimizer", optimizer])[0].resolved().weight_decay == 0.1
  assert train_gpt.parse_args(TINY)[0].resolved().weight_decay == 0.0
  model = make_model(cfg)
  routing = routing_of(model, cfg)
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  alias = FAMILY[optimizer][0]
  reference = optax.chain(optax.clip_by_global_norm(1.0), alias(
      lr_schedule(cfg.peak_lr, cfg), routing=routing, ns=cfg.ns,
      adam=mo.AuxAdam(lr_schedule(cfg.peak_adam_lr, cfg), b1=0.9, b2=0.95),
      weight_decay=mo.WeightDecay(0.05, cautious=cautious)))
  for ours, theirs in zip(_updates(make_optimizer(cfg, routing), params),
                          _updates(reference, params)):
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
      np.testing.assert_array_equal(a, b)


def _best_rates(path: pathlib.Path) -> dict[str, float]:
  """optimizer -> lr of the first "best rate" table of a convergence results file (the
  default configuration's), without the Newton–Schulz preset rows."""
  lines = path.read_text().splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith("| optimizer | lr |"))
  rates = {}
  for line in lines[start + 2:]:
    if not line.startswith("|"):
      break
    name, lr = (cell.strip() for cell in line.strip("|").split("|")[:2])
    if " " not in name:
      rates[name] = float(lr)
  return rates


def test_default_rates_are_the_sweeps_best():
  """Every optimizer's default --lr is the best of its sweep in the results files."""
  from workload.config import BEST_LR, OPTIMIZERS

  results = pathlib.Path(__file__).parent.parent / "benchmarks" / "results"
  found = {**_best_rates(results / "convergence.txt"), **_best_rates(results / "frontier.txt")}
  assert sorted(found) == sorted(OPTIMIZERS)
  assert {name: BEST_LR[name] for name in OPTIMIZERS} == found


def test_run_json_records_the_decay_that_acted(tmp_path):
  result = train_gpt.main(TINY + ["--optimizer", "muon-wd", "--steps", "2", "--eval-every", "2",
                                  "--out-dir", str(tmp_path)])
  assert result["runs"][0]["config"]["weight_decay"] == 0.1
  saved = json.loads((tmp_path / "run.json").read_text())
  assert saved["runs"][0]["config"]["weight_decay"] == 0.1


def test_every_newton_schulz_preset_is_a_cli_choice():
  from workload.config import NS_PRESETS

  assert set(NS_PRESETS) == set(mo.PRESETS)


def test_muonbp_presets_refuse_another_device_count():
  from workload.config import TrainConfig

  with pytest.raises(ValueError, match="--devices 1 .* or 8, not 4"):
    TrainConfig(optimizer="muonbp4", devices=4)
  TrainConfig(optimizer="muonbp4", devices=8)
