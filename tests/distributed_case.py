"""The small training case shared by the multi-process worker and its test: four Muon
matrices for eight devices, so the exchange also splits matrices between devices."""

import jax
import jax.numpy as jnp

import muon_optax as mo

STEPS = 5


def make_params():
  ks = jax.random.split(jax.random.key(0), 4)
  return {"embed": {"embedding": jax.random.normal(ks[0], (64, 32))},
          "fc": {"kernel": jax.random.normal(ks[1], (32, 128)) * 0.1, "bias": jnp.zeros(128)},
          "proj": {"kernel": jax.random.normal(ks[2], (128, 32)) * 0.1},
          "sq": {"kernel": jax.random.normal(ks[3], (2, 32, 32)) * 0.1}}


def grads_at(step, params):
  return jax.tree.map(lambda p: jax.random.normal(jax.random.key(50 + step), p.shape), params)


def optimizer(mesh=None):
  # Flops alone decide the splits: these small matrices would not pay for their traffic.
  layout = None if mesh is None else mo.MeshLayout(mesh, flops_per_byte=0)
  return mo.muon(0.05, weight_decay=0.01, mesh=layout, adam=mo.AuxAdam(1e-2, backend="optax"))
