"""Every ```python block of README.md and of the docs pages runs as written, in order, in one
namespace; and what
the README claims about optax.contrib.muon holds."""

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# The README, then the guides in the site's order: their blocks run in one namespace,
# each page building on the ones before it as a reader does.
PAGES = [README] + [ROOT / "docs" / name for name in (
    "routing.md", "family.md", "frontier.md", "details.md", "meshes.md", "optax.md",
    "training_loop.md")]


def documented_blocks() -> list[str]:
  return [block for page in PAGES for block in python_blocks(page.read_text())]

# Runs the blocks (a JSON list, argv[1]) in one namespace. Right after the first block
# that builds an optax.contrib.muon, before later blocks can rebind its names, it runs
# the epilogue (argv[2]), which prints one JSON line starting with "RESULT ".
RUNNER = r"""
import json, sys
blocks, epilogue = json.load(open(sys.argv[1])), open(sys.argv[2]).read()
namespace, checked = {"__name__": "__readme__"}, False
for i, code in enumerate(blocks, 1):
  print(f"--- README python block {i} ---", flush=True)
  exec(compile(code, f"README.md python block {i}", "exec"), namespace)
  if not checked and "optax.contrib.muon(" in code:
    print("--- epilogue ---", flush=True)
    exec(compile(epilogue, "epilogue", "exec"), namespace)
    checked = True
"""

# In the README's namespace, after its optax.contrib.muon snippet: the snippet's `ours`,
# `theirs`, `run`, `tree` and `every_matrix` against optax run in float64 as the exact
# reference.
EPILOGUE = r"""
import json
import numpy as np
import jax, jax.numpy as jnp, optax.contrib

def errors(tx_ours, tx_theirs, steps=5):
  ours32, theirs32 = run(tx_ours, tree, steps), run(tx_theirs, tree, steps)
  with jax.enable_x64(True):
    ref = run(tx_theirs, jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), tree), steps)
    ref = jax.tree.map(np.asarray, ref)
  return {k: {"ours": float(np.max(np.abs(np.asarray(ours32[k], np.float64) - ref[k]))),
              "theirs": float(np.max(np.abs(np.asarray(theirs32[k], np.float64) - ref[k]))),
              "scale": float(np.max(np.abs(ref[k]))), "label": every_matrix(tree)[k]}
          for k in tree}

nesterov_ours = mo.muon(0.02, routing=every_matrix, ns=mo.NewtonSchulz("jordan", steps=5, gram=False),
                        adam=mo.AuxAdam(3e-3, nesterov=True))
nesterov_theirs = optax.contrib.muon(0.02, adam_learning_rate=3e-3)
print("RESULT " + json.dumps({"plain": errors(ours, theirs),
                              "nesterov": errors(nesterov_ours, nesterov_theirs),
                              "nesterov_step_1": errors(nesterov_ours, nesterov_theirs, 1)}))
"""


def python_blocks(text: str) -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
  """Runs README's blocks + the epilogue in a fresh process with 8 simulated devices."""
  tmp = tmp_path_factory.mktemp("readme")
  (tmp / "blocks.json").write_text(json.dumps(documented_blocks()))
  (tmp / "epilogue.py").write_text(EPILOGUE)
  env = dict(os.environ, JAX_PLATFORMS="cpu", MPLBACKEND="Agg")  # 8 devices, as here
  env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH")] if p)
  return subprocess.run([sys.executable, "-c", RUNNER, str(tmp / "blocks.json"),
                         str(tmp / "epilogue.py")], cwd=tmp, env=env, capture_output=True,
                        text=True, timeout=900)


def test_readme_has_python_blocks():
  blocks = documented_blocks()
  assert len(blocks) >= 4, "expected quickstart, nnx, mesh and optax blocks"
  assert all(b.strip() for b in blocks)


def test_every_readme_python_block_runs_in_order(readme_run):
  assert readme_run.returncode == 0, readme_run.stdout[-3000:] + readme_run.stderr[-5000:]


def test_a_printed_output_shown_in_the_docs_is_what_its_block_prints(readme_run):
  """A ```python block whose line says `# the table below` is followed by a plain block
  holding what it prints: that text is in the run's output as shown."""
  assert readme_run.returncode == 0, readme_run.stderr[-3000:]
  shown = [block for page in PAGES for block in re.findall(
      r"# the table below[^\n]*\n.*?^```\n\n```\n(.*?)^```", page.read_text(), re.S | re.M)]
  assert shown, "no docs block shows its printed output"
  for text in shown:
    assert text.strip() in readme_run.stdout, text


def _result(readme_run):
  if readme_run.returncode:
    pytest.fail("README blocks failed: " + readme_run.stderr[-3000:])
  lines = [l for l in readme_run.stdout.splitlines() if l.startswith("RESULT ")]
  assert lines, "no README python block builds an optax.contrib.muon to compare with"
  line = lines[0]
  return json.loads(line[len("RESULT "):])


def _float32_tolerance(leaf):
  """4× optax's own float32 error against its float64 run, at least 4 ulps of the params."""
  return 4 * max(leaf["theirs"], np.finfo(np.float32).eps * leaf["scale"])


def test_readme_snippet_reproduces_optax_contrib_muon_without_nesterov(readme_run):
  for name, leaf in _result(readme_run)["plain"].items():
    assert leaf["ours"] <= _float32_tolerance(leaf), (name, leaf)


def test_with_nesterov_only_the_adam_leaves_match_optax(readme_run):
  """AuxAdam(nesterov=True) is optax's NAdam branch; the Muon leaves differ because optax
  bias-corrects its Nesterov momentum (far beyond float32 rounding after 5 steps)."""
  result = _result(readme_run)
  for name, leaf in result["nesterov"].items():
    if leaf["label"] == "adam":
      assert leaf["ours"] <= _float32_tolerance(leaf), (name, leaf)
    else:
      assert leaf["ours"] > 100 * _float32_tolerance(leaf), (name, leaf)
  # At step 1 the two momenta are proportional, which Newton–Schulz does not see.
  for name, leaf in result["nesterov_step_1"].items():
    assert leaf["ours"] <= _float32_tolerance(leaf), (name, leaf)


def test_optax_nesterov_turns_its_adamw_branch_into_nadam():
  """The README's first difference, on optax alone: its adam leaves follow
  optax.adamw(nesterov=True), not plain AdamW."""
  import jax.numpy as jnp
  import optax
  import optax.contrib

  params = {"b": jnp.linspace(-1.0, 1.0, 7)}
  grads = [{"b": jnp.cos(3.0 * params["b"] + i)} for i in range(3)]

  def run(tx):
    state, p = tx.init(params), params
    for g in grads:
      u, state = tx.update(g, state, p)
      p = optax.apply_updates(p, u)
    return np.asarray(p["b"])

  contrib = run(optax.contrib.muon(0.02, adam_learning_rate=1e-2))
  nadam = run(optax.adamw(1e-2, weight_decay=0.0, nesterov=True))
  adam = run(optax.adamw(1e-2, weight_decay=0.0))
  eps = np.finfo(np.float32).eps
  np.testing.assert_allclose(contrib, nadam, rtol=0, atol=8 * eps)
  assert np.max(np.abs(contrib - adam)) > 1e3 * eps
