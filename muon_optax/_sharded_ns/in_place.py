"""Owned stacks: matrices that already lie whole on their devices are orthogonalized where
they lie, with no exchange."""

from __future__ import annotations

from typing import Optional

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from muon_optax._placement.shardings import shard_mapped, spec_axes
from muon_optax._sharded_ns.factor_mesh import FactorMesh


def in_place(ns_fn, fmesh: FactorMesh, x, spec: P, out_spec: Optional[P]):
  """An owned stack orthogonalized where it lies, with no exchange; all-gathered if it is
  wanted replicated (`out_spec` None), else laid out as `out_spec`."""
  spec = fmesh.spec(P(*(list(spec) + [None] * 3)[:3]))
  axes = spec_axes(spec[0])
  gather = out_spec is None
  body = (lambda b: jax.lax.all_gather(ns_fn(b), axes, axis=0, tiled=True)) if gather else ns_fn
  y = shard_mapped(body, fmesh.mesh, (spec,), P() if gather else spec)(x)
  if not gather and fmesh.spec(out_spec) != spec:
    y = jax.lax.with_sharding_constraint(y, NamedSharding(fmesh.mesh, fmesh.spec(out_spec)))
  return y
