"""The checkpoint record and its comparison with a restore target, the array checksums
and the file inventory, without Orbax."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import muon_optax as mo
from muon_optax import _routing
from muon_optax.checkpoint import _checksum, _files, _record


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


def sharded_copies(x):
  """`x` laid out as checkpoints get restored: split over 8 or 4 devices (along either
  axis), on one device, and replicated."""
  layouts = [(8, P("data")), (4, P(None, "data")), (1, P()), (8, P())]
  return [jax.device_put(x, NamedSharding(jax.make_mesh((n,), ("data",),
                                                        devices=jax.devices()[:n]), spec))
          for n, spec in layouts]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "bool", "complex64", "uint8"])
def test_checksums_do_not_depend_on_the_sharding(dtype):
  x = (jax.random.normal(jax.random.key(0), (16, 24)) * 50).astype(dtype)
  expected = _checksum.checksums({"x": x})["x"]
  for copy in sharded_copies(x):
    assert _checksum.checksums({"x": copy}) == {"x": expected}, copy.sharding


def test_checksums_gather_no_array():
  mesh = jax.make_mesh((8,), ("data",))
  x = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P("data")))
  hlo = _checksum._checksum.lower(x).compile().as_text()
  assert "all-gather" not in hlo and "all-to-all" not in hlo


def test_any_changed_element_changes_the_checksum():
  x = jax.random.normal(jax.random.key(1), (8, 8))
  base = _checksum.checksums(x)
  flipped = jax.lax.bitcast_convert_type(x, jnp.uint32).at[3, 5].add(1 << 20)
  swapped = x.at[0, 0].set(x[0, 1]).at[0, 1].set(x[0, 0])
  for changed in (jax.lax.bitcast_convert_type(flipped, jnp.float32), swapped, x.T, -x):
    assert _checksum.checksums(changed) != base


def test_checksum_differences_name_each_leaf():
  saved = {"params": {"a": 1, "b": 2}, "opt_state": {"mu/a": 3}}
  restored = {"params": {"a": 1, "b": 7}, "opt_state": {}}
  assert _record.checksum_differences(saved, restored) == [
      "params leaf 'b': checksum 0x00000007 after restore, 0x00000002 when saved",
      "opt_state leaf 'mu/a': no such leaf after restore, 0x00000003 when saved"]


def test_the_inventory_finds_missing_resized_and_changed_files(tmp_path):
  (tmp_path / "params" / "d").mkdir(parents=True)
  (tmp_path / "params" / "_METADATA").write_text('{"tree": 1}')
  (tmp_path / "params" / "d" / "chunk").write_bytes(b"\0" * 64)
  _files.write_inventory(str(tmp_path))
  assert _files.problems(str(tmp_path), contents=True) == []
  (tmp_path / "params" / "_METADATA").write_text('{"tree": 2}')  # same size
  (tmp_path / "params" / "d" / "chunk").write_bytes(b"\0" * 32)
  assert _files.problems(str(tmp_path)) == [f"{tmp_path}/params/d/chunk: 32 bytes, 64 when saved"]
  assert _files.problems(str(tmp_path), contents=True)[0] == (
      f"{tmp_path}/params/_METADATA: its bytes differ from those saved (CRC-32 mismatch)")
  (tmp_path / "params" / "d" / "chunk").unlink()
  assert _files.problems(str(tmp_path), only="params/d") == [
      f"{tmp_path}/params/d/chunk: missing"]
  (tmp_path / _files.INVENTORY).unlink()
  assert "no readable file inventory" in _files.problems(str(tmp_path))[0]
