"""Task-vector methods behind one interface (`base.Method`): the paper's LTV and the
baselines it is compared with. A new method is one module here and one line in `METHODS`.

  ltv   LTV: ridge map h_zs → h_icl − h_zs, before the LM head           (ltv.py)
  mean  constant mapping c* = mean(h_icl − h_zs)                          (ltv.py)
  mlp   ReLU MLP map trained with MSE on the same pairs                   (mlp.py)
  tv    Task Vector: a layer's last-token state, replaced                 (tv.py)
  fv    Function Vector: top heads by indirect effect, added at a layer   (fv.py)
  sv    State Vector: separator attention states in the first layers      (sv.py)
  i2cl  I2CL: attention / MLP context vectors at every layer and token    (i2cl.py)
"""

from __future__ import annotations

from ..errors import ArgumentError
from .artifact import Artifact, load_artifact
from .base import Context, Method, MethodError, MethodOptions
from .fv import FV
from .i2cl import I2CL
from .ltv import LTV, Mean
from .mlp import MLP
from .sv import SV
from .tv import TV

METHODS: dict[str, Method] = {m.name: m for m in (LTV(), Mean(), TV(), FV(), SV(), I2CL(), MLP())}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ArgumentError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    return METHODS[name]


__all__ = ["METHODS", "Artifact", "Context", "Method", "MethodError", "MethodOptions",
           "get_method", "load_artifact"]
