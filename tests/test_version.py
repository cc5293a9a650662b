"""The version: one string, which the package metadata reads from the module."""

import pathlib
import re

from packaging.version import Version

import muon_optax as mo
from muon_optax import _version

PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_the_metadata_reads_the_version_from_the_module():
  text = PYPROJECT.read_text()
  assert re.search(r'^dynamic = \["version"\]', text, re.M)
  attr = re.search(r'^version = \{attr = "([\w.]+)"\}', text, re.M).group(1)
  module, _, name = attr.rpartition(".")
  assert module == _version.__name__ and getattr(_version, name) is mo.__version__


def test_the_version_is_a_pep_440_release():
  assert str(Version(mo.__version__)) == mo.__version__
  assert Version(mo.__version__).release == tuple(int(n) for n in mo.__version__.split("."))
