"""Type aliases shared by the public signatures."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

from jax.typing import ArrayLike

# A number or array, or a schedule step -> value (what optax takes as a learning rate).
ScalarOrSchedule = Union[ArrayLike, Callable[[ArrayLike], ArrayLike]]
# A pytree of bools matching the params (or a prefix), a callable params -> that, or None.
Mask = Union[None, Any, Callable[[Any], Any]]
