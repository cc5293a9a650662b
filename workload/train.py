"""The workload's training loop: one run of a `TrainConfig` (model, optimizer, data,
optional mesh and checkpoints), returning its record; and the summaries of runs that
`examples/train_gpt.py` and `benchmarks/convergence.py` print."""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

import muon_optax as mo
from workload import stdlib_text
from workload.config import BLOCK_DEVICES, TrainConfig
from workload.gpt import GPT, GPTConfig, loss_fn, num_params
from workload.machine import machine_info

# The Muon family: each optimizer of the config as a muon_optax alias and its options.
# The decay presets decay by the config's weight decay (`PRESET_DECAY` unless the flag
# gives another), cautiously for -cwd.
FAMILY = {"muon": (mo.muon, {}), "normuon": (mo.normuon, {}), "adamuon": (mo.adamuon, {}),
          "adaptive": (mo.muon, {"scale": "adaptive"}),
          "nordion2": (mo.nordion2, {"fraction": 0.25}),
          "nordion2-0.5": (mo.nordion2, {"fraction": 0.5}),
          "nordion2-1": (mo.nordion2, {"fraction": 1.0}),
          "muonbp4": (mo.muonbp, {"blocks": mo.BlockPeriodic(4, devices=BLOCK_DEVICES)}),
          "muonbp8": (mo.muonbp, {"blocks": mo.BlockPeriodic(8, devices=BLOCK_DEVICES)}),
          "muon-wd": (mo.muon, {}), "muon-cwd": (mo.muon, {}),
          "normuon-wd": (mo.normuon, {}), "normuon-cwd": (mo.normuon, {}),
          "muonh": (mo.muonh, {}),
          "muon-no-nesterov": (mo.muon, {"nesterov": False})}
CAUTIOUS = ("muon-cwd", "normuon-cwd")


def lr_schedule(peak: float, cfg: TrainConfig) -> optax.Schedule:
  """Linear warmup from 0 over `cfg.warmup` of the steps, then cosine decay to 10% of peak."""
  warmup = max(1, int(cfg.warmup * cfg.steps))
  return optax.warmup_cosine_decay_schedule(
      0.0, peak, warmup, max(cfg.steps, warmup + 1), end_value=0.1 * peak)


def make_model(cfg: TrainConfig) -> GPT:
  return GPT(GPTConfig(seq_len=cfg.seq_len, d_model=cfg.d_model, layers=cfg.layers,
                       heads=cfg.heads, tie_embeddings=cfg.tie_embeddings,
                       attention=cfg.attention), rngs=nnx.Rngs(cfg.seed))


def routing_of(model: nnx.Module, cfg: TrainConfig) -> mo.Routing:
  """Which parameters Muon updates, read from the model's computation on a token batch;
  with `split_fused=False`, a fused kernel stays one matrix."""
  routing = mo.infer_routing(model, jnp.zeros((1, cfg.seq_len), jnp.int32))
  if cfg.split_fused:
    return routing
  whole = lambda path, shape: (view._replace(blocks=1) if (view := routing.view(path, shape))
                               is not None else None)
  return mo.infer_routing(model, jnp.zeros((1, cfg.seq_len), jnp.int32), views=whole)


def make_optimizer(cfg: TrainConfig, routing: mo.Routing,
                   mesh: Optional[jax.sharding.Mesh] = None) -> optax.GradientTransformation:
  """A Muon-family optimizer (+ aux AdamW) or AdamW, clipped, on a warmup+cosine schedule.

  With a mesh, the family orthogonalizes whole matrices dealt over its devices. Weight
  decay is applied to the hidden matrices only (those `routing` sends to Muon), so
  every optimizer decays the same parameters.
  """
  adam_lr = lr_schedule(cfg.peak_adam_lr, cfg)
  decay = cfg.resolved().weight_decay
  if cfg.optimizer == "adamw":
    hidden = lambda params: jax.tree.map(lambda l: l == "muon", routing.labels(params))
    tx = optax.adamw(adam_lr, b1=0.9, b2=0.95, weight_decay=decay, mask=hidden)
  else:
    alias, options = FAMILY[cfg.optimizer]
    # ZeRO-1 (`place_data_parallel`): the params are replicated, the state split.
    placed = None if mesh is None else mo.MeshLayout(mesh, params="replicated")
    if alias is mo.muonh:  # the hyperball takes the place of weight decay
      if decay:
        raise ValueError("muonh keeps each matrix's norm instead of decaying it: drop "
                         "--weight-decay.")
    else:
      options = {"weight_decay": mo.WeightDecay(decay, cautious=cfg.optimizer in CAUTIOUS),
                 **options}
    tx = alias(lr_schedule(cfg.peak_lr, cfg), mesh=placed, routing=routing, ns=cfg.ns,
               adam=mo.AuxAdam(adam_lr, b1=0.9, b2=0.95), **options)
  return optax.chain(optax.clip_by_global_norm(1.0), tx)


def data_mesh(devices: int) -> Optional[jax.sharding.Mesh]:
  """A 1-D "data" mesh over the first `devices` devices, or None for one device."""
  if devices <= 1:
    return None
  if jax.device_count() < devices:
    raise ValueError(
        f"--devices {devices} but jax sees {jax.device_count()} device(s). Run "
        "`python -m examples.train_gpt` (it sets XLA_FLAGS=--xla_force_host_platform_"
        "device_count=N before importing jax), or set that flag before jax is imported.")
  # Auto axes: XLA propagates the batch sharding through the model. (On an Explicit
  # mesh nnx.Embed's gather needs an out_sharding it does not yet take.)
  return jax.make_mesh((devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:devices])


def place_data_parallel(mesh: Optional[jax.sharding.Mesh], model: nnx.Module,
                        optimizer: nnx.Optimizer) -> Callable[[np.ndarray], jax.Array]:
  """ZeRO-1 on `mesh`: replicates the model, splits the optimizer state along "data"
  (`mo.state_shardings`), and returns the function that puts a host batch on the
  devices split along "data"; XLA inserts the gradient all-reduce. Without a mesh,
  batches simply go to the default device."""
  if mesh is None:
    return jnp.asarray
  params = jax.device_put(nnx.state(model), NamedSharding(mesh, P()))
  nnx.update(model, params)
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  shardings = mo.state_shardings(optimizer.tx, params, mesh)
  # A fresh state, made in place on the mesh; nnx.state maps it onto the optimizer's.
  nnx.update(optimizer.opt_state,
             nnx.state(jax.jit(optimizer.tx.init, out_shardings=shardings)(params)))
  optimizer.step.set_value(jax.device_put(optimizer.step.get_value(), NamedSharding(mesh, P())))
  return lambda batch: jax.device_put(batch, NamedSharding(mesh, P("data")))


def _values(tree: Any) -> Any:
  """nnx Variables -> their arrays: the plain pytrees a checkpoint holds."""
  return jax.tree.map(lambda v: v.get_value(), tree,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


def checkpointed(model: nnx.Module, optimizer: nnx.Optimizer) -> tuple[Any, Any]:
  """(params, optimizer state) as the live nnx Variables that are saved and restored."""
  return nnx.state(model, nnx.Param), {"step": optimizer.step, "opt_state": optimizer.opt_state}


def restore_latest(ckpt: mo.checkpoint.Checkpointer, model: nnx.Module,
                   optimizer: nnx.Optimizer) -> int:
  """Loads the latest checkpoint into model and optimizer; returns its step (0: none)."""
  if ckpt.latest_step() is None:
    return 0
  variables = checkpointed(model, optimizer)
  # The current arrays are the target: they give shapes, dtypes and shardings.
  restored = ckpt.restore(params_target=_values(variables[0]),
                          opt_state_target=_values(variables[1]))
  jax.tree.map(lambda v, x: v.set_value(x), variables, (restored.params, restored.opt_state),
               is_leaf=lambda x: isinstance(x, nnx.Variable))
  return restored.step


@dataclasses.dataclass
class Setup:
  """What one run trains with: the model and optimizer (placed on the mesh, resumed from
  a checkpoint if asked), the jitted steps, the validation set and the checkpointer."""

  model: nnx.Module
  optimizer: nnx.Optimizer
  routing: mo.Routing
  shard: Callable[[np.ndarray], jax.Array]
  step_fn: Callable[[jax.Array], jax.Array]
  evaluate: Callable[[], float]
  ckpt: Optional[mo.checkpoint.Checkpointer]
  start_step: int


@dataclasses.dataclass
class Curves:
  """What the loop measured: losses, and where the time went."""

  train_losses: list[float] = dataclasses.field(default_factory=list)
  val_curve: list[tuple[int, float]] = dataclasses.field(default_factory=list)
  compile_s: Optional[float] = None
  loop_start: Optional[float] = None
  eval_s: float = 0.0


def setup(cfg: TrainConfig, val_data: np.ndarray, log: Callable[[str], None]) -> Setup:
  """Model, optimizer, mesh placement, jitted steps, validation batches, checkpoints."""
  mesh = data_mesh(cfg.devices)
  if cfg.batch % cfg.devices:
    raise ValueError(f"--batch {cfg.batch} must be a multiple of --devices {cfg.devices}.")
  model = make_model(cfg)
  routing = routing_of(model, cfg)
  optimizer = nnx.Optimizer(model, make_optimizer(cfg, routing, mesh), wrt=nnx.Param)
  shard = place_data_parallel(mesh, model, optimizer)

  @nnx.jit
  def train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss

  # cached_partial skips re-walking the model and optimizer graphs on every call, a
  # large share of the step time for a model this small.
  step_fn = nnx.cached_partial(train_step, model, optimizer)
  eval_step = nnx.jit(loss_fn)
  val_set = [shard(b) for b in stdlib_text.eval_batches(
      val_data, cfg.batch, cfg.seq_len, cfg.eval_batches, seed=10_000 + cfg.seed)]
  evaluate = lambda: float(np.mean([eval_step(model, b) for b in val_set]))
  ckpt_dir = pathlib.Path(cfg.checkpoint_dir) / cfg.optimizer if cfg.checkpoint_dir else None
  ckpt = mo.checkpoint.Checkpointer(ckpt_dir, routing=routing) if ckpt_dir else None
  if cfg.resume and ckpt is None:
    raise ValueError("--resume needs --checkpoint-dir.")
  start_step = restore_latest(ckpt, model, optimizer) if cfg.resume else 0
  if start_step >= cfg.steps:
    raise ValueError(f"the checkpoint is at step {start_step}; raise --steps to train further.")
  if start_step:
    log(f"{cfg.optimizer}: resumed from step {start_step} in {ckpt_dir}")
  return Setup(model, optimizer, routing, shard, step_fn, evaluate, ckpt, start_step)


def loop(cfg: TrainConfig, run: Setup, train_data: np.ndarray, progress: Optional[bool],
         log: Callable[[str], None]) -> Curves:
  """The training steps from `run.start_step`, with a validation (and a checkpoint) every
  `eval_every` steps and at the end."""
  data = stdlib_text.batches(train_data, cfg.batch, cfg.seq_len, cfg.seed,
                             start_step=run.start_step)
  curves = Curves()
  pending: list[jax.Array] = []  # losses not yet fetched: fetching every step would sync
  tokens_per_step, show_lr = cfg.batch * cfg.seq_len, lr_schedule(cfg.peak_lr, cfg)
  t_log, tokens_since = None, 0
  bar = tqdm(range(run.start_step, cfg.steps), desc=cfg.optimizer, dynamic_ncols=True,
             disable=None if progress is None else not progress, leave=progress is not None)
  for step in bar:
    t0 = time.perf_counter()
    pending.append(run.step_fn(run.shard(next(data))))
    if curves.compile_s is None:
      pending[-1].block_until_ready()
      curves.compile_s = time.perf_counter() - t0
      curves.loop_start = t_log = time.perf_counter()
    else:
      tokens_since += tokens_per_step
    last = step + 1 == cfg.steps
    evaluate_now = (step + 1) % cfg.eval_every == 0 or last
    if (step + 1) % 10 == 0 or evaluate_now:
      curves.train_losses += [float(x) for x in pending]
      pending.clear()
      now = time.perf_counter()
      tok_s = tokens_since / max(now - t_log, 1e-9)
      t_log, tokens_since = now, 0
      bar.set_postfix(loss=f"{curves.train_losses[-1]:.3f}", tok_s=f"{tok_s:,.0f}",
                      lr=f"{float(show_lr(step)):.2e}")
    if evaluate_now:
      t_eval = time.perf_counter()
      curves.val_curve.append((step + 1, run.evaluate()))
      if run.ckpt is not None:  # written in the background; counted with evaluation
        run.ckpt.save(step + 1, *map(_values, checkpointed(run.model, run.optimizer)),
                      metadata={"val_loss": curves.val_curve[-1][1]})
      t_log = time.perf_counter()  # tokens/s counts training only
      curves.eval_s += t_log - t_eval
      log(f"{cfg.optimizer:<5} step {step + 1:>6}  train "
          f"{np.mean(curves.train_losses[-10:]):.4f}  val {curves.val_curve[-1][1]:.4f}")
  bar.close()
  if run.ckpt is not None:
    run.ckpt.close()  # waits for the last save
  return curves


def record(cfg: TrainConfig, run: Setup, curves: Curves, t_start: float) -> dict[str, Any]:
  """The run record: config, curves, final numbers, timings."""
  t_end = time.perf_counter()
  params = nnx.state(run.model, nnx.Param)
  n_params, tokens_per_step = num_params(run.model), cfg.batch * cfg.seq_len
  steady_steps = cfg.steps - run.start_step - 1
  tail = curves.train_losses[-min(20, len(curves.train_losses)):]
  train_s = max(t_end - curves.loop_start - curves.eval_s, 1e-9)
  return {
      "optimizer": cfg.optimizer,
      "config": dataclasses.asdict(cfg.resolved()),
      "params": n_params,
      "ns_flops_per_step": (0 if cfg.optimizer == "adamw" else
                            mo.newton_schulz_cost(params, routing=run.routing, ns=cfg.ns)),
      "train_flops_per_step": 6 * n_params * tokens_per_step,
      "steps": cfg.steps,
      "start_step": run.start_step,
      "tokens": cfg.steps * tokens_per_step,
      "train_loss": curves.train_losses,
      "val_loss": curves.val_curve,
      "final_train_loss": float(np.mean(tail)),
      "final_val_loss": curves.val_curve[-1][1],
      "best_val_loss": min(v for _, v in curves.val_curve),
      "time_s": t_end - t_start,
      "compile_s": curves.compile_s,
      "eval_s": curves.eval_s,
      "tokens_per_s": steady_steps * tokens_per_step / train_s,
      "machine": machine_info(),
  }


def train(cfg: TrainConfig, train_data: np.ndarray, val_data: np.ndarray, *,
          progress: Optional[bool] = True, log: Callable[[str], None] = print
          ) -> dict[str, Any]:
  """Trains one model; returns the run record (config, curves, final numbers, timings).

  `progress`: show a progress bar (None: only when stderr is a terminal); `log`
  receives one line per validation.
  """
  t_start = time.perf_counter()
  run = setup(cfg, val_data, log)
  return record(cfg, run, loop(cfg, run, train_data, progress, log), t_start)


def plot_runs(records: list[dict[str, Any]], path: pathlib.Path, title: str = "") -> None:
  """Train (thin, smoothed) and validation (markers) loss curves of one or more runs."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 5))
  for i, r in enumerate(records):
    color = f"C{i}"
    label = r.get("label", r["optimizer"])
    loss = np.asarray(r["train_loss"])
    k = max(1, min(20, len(loss) // 10))
    smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
    ax.plot(np.arange(k, len(loss) + 1), smooth, color=color, lw=1, alpha=0.6,
            label=f"{label} train")
    steps, val = zip(*r["val_loss"])
    ax.plot(steps, val, "o-", color=color, ms=3, label=f"{label} val")
  ax.set(xlabel="step", ylabel="cross-entropy (nats/byte)", title=title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def summary_table(records: list[dict[str, Any]]) -> str:
  """One row per run: optimizer, steps, tokens, final train/val loss, time."""
  header = ("optimizer", "steps", "tokens", "train loss", "val loss", "time (s)")
  rows = [(r.get("label", r["optimizer"]), str(r["steps"]), f"{r['tokens']:,}",
           f"{r['final_train_loss']:.4f}", f"{r['final_val_loss']:.4f}", f"{r['time_s']:.1f}")
          for r in records]
  widths = [max(len(x[i]) for x in rows + [header]) for i in range(len(header))]
  fmt = lambda row: "  ".join(c.rjust(w) if i else c.ljust(w)
                              for i, (c, w) in enumerate(zip(row, widths)))
  return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def steps_to_reach(val_curve: list[tuple[int, float]], target: float) -> Optional[float]:
  """First step at which the validation curve reaches `target`, linearly interpolated
  between evaluations (from step 0, where no curve is below target); None if never."""
  prev_step, prev_loss = 0, float("inf")
  for step, loss in val_curve:
    if loss <= target:
      if not np.isfinite(prev_loss):
        return float(step)
      return prev_step + (step - prev_step) * (prev_loss - target) / (prev_loss - loss)
    prev_step, prev_loss = step, loss
  return None
