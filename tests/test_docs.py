"""The documentation site builds in strict mode (a broken link, reference or docstring
fails it); its pages' code blocks run in tests/test_readme.py."""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_site_builds_in_strict_mode(tmp_path):
  mkdocs = shutil.which("mkdocs", path=str(pathlib.Path(sys.executable).parent)) or shutil.which(
      "mkdocs")
  if mkdocs is None:
    pytest.fail('mkdocs is not installed: `pip install -e ".[all]"` installs it (the docs extra)')
  done = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
                        cwd=ROOT, capture_output=True, text=True, timeout=600,
                        env={"NO_MKDOCS_2_WARNING": "1", "JAX_PLATFORMS": "cpu",
                             "PATH": str(pathlib.Path(sys.executable).parent) + ":/usr/bin:/bin"})
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  for page in ("routing", "family", "frontier", "details", "meshes", "mesh_results", "mesh_design",
               "optax", "training_loop", "api"):
    assert (tmp_path / "site" / page / "index.html").exists(), page


def test_every_docs_page_is_in_the_site_and_linked_from_the_readme():
  nav = (ROOT / "mkdocs.yml").read_text()
  readme = (ROOT / "README.md").read_text()
  for page in sorted((ROOT / "docs").glob("*.md")):
    assert page.name in nav, f"docs/{page.name} is not in mkdocs.yml's nav"
    if page.name != "index.md":
      assert f"(docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"
