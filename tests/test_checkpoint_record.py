"""The checkpoint record and its comparison with a restore target, without Orbax."""

import jax
import jax.numpy as jnp
import pytest

import muon_optax as mo
from muon_optax import _routing
from muon_optax.checkpoint import _record


def record(params, tx=None, labels=None):
  tx = tx or mo.muon(0.02, routing=labels)
  state = jax.eval_shape(tx.init, params)
  return _record.record(params, state, _routing.as_routing(labels))


def wide_params(n, width=8):
  return {f"layer{i:02d}": {"kernel": jax.ShapeDtypeStruct((width, width), jnp.float32)}
          for i in range(n)}


def test_record_names_shapes_labels_and_backends():
  params = {"mlp": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)}}
  rec = record(params, mo.muon(0.02, adam=mo.AuxAdam(backend="reference")))
  assert rec["params"] == {"mlp/bias": {"shape": [8], "dtype": "float32"},
                           "mlp/kernel": {"shape": [4, 8], "dtype": "float32"}}
  assert rec["routing"]["mlp/kernel"]["label"] == "muon"
  assert rec["routing"]["mlp/bias"] == {"label": "adam", "view": None}
  assert rec["adam_backends"] == {"inner_states/adam/inner_state": "reference"}


def test_every_difference_is_listed_up_to_a_readable_number():
  n = _record.MAX_LISTED + 5
  saved, current = record(wide_params(n)), record(wide_params(n, width=16))
  with pytest.raises(ValueError) as error:
    _record.check_fits(saved, current, "step 3 ")
  message = str(error.value)
  assert message.startswith(f"step 3 does not fit the restore target: {n} differences:")
  listed = [line for line in message.splitlines() if line.startswith("  parameter ")]
  assert len(listed) == _record.MAX_LISTED
  assert listed[0] == ("  parameter 'layer00/kernel' has shape (8, 8) in the checkpoint but "
                       "(16, 16) in the target")
  assert message.endswith("\n  ... and 5 more")


def test_identical_records_fit_and_backends_may_differ():
  params = wide_params(2)
  saved = record(params, mo.muon(0.02, adam=mo.AuxAdam(backend="reference")))
  _record.check_fits(saved, record(params, mo.muon(0.02, adam=mo.AuxAdam(backend="optax"))), "")


def test_a_newer_format_asks_for_an_upgrade():
  params = wide_params(1)
  saved = {**record(params), "format": _record.FORMAT + 1, "muon_optax_version": "9.0"}
  with pytest.raises(ValueError, match="written by muon_optax 9.0 in a newer format; upgrade"):
    _record.check_fits(saved, record(params), "")


def test_checksum_differences_name_each_leaf():
  saved = {"params": {"a": 1, "b": 2}, "opt_state": {"mu/a": 3}}
  restored = {"params": {"a": 1, "b": 7}, "opt_state": {}}
  assert _record.checksum_differences(saved, restored) == [
      "params leaf 'b': checksum 0x00000007 after restore, 0x00000002 when saved",
      "opt_state leaf 'mu/a': no such leaf after restore, 0x00000003 when saved"]
