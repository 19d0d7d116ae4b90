"""The registry: method name → its one instance."""

from __future__ import annotations

from ..errors import ArgumentError
from .base import Method
from .fv import FV
from .i2cl import I2CL, I2CLCalibrated
from .ltv import LTV, KernelLTV, LTVAuto, Mean
from .mlp import MLP
from .sv import SV
from .tv import TV

METHODS: dict[str, Method] = {m.name: m for m in (LTV(), LTVAuto(), KernelLTV(), Mean(), TV(),
                                                  FV(), SV(), I2CL(), I2CLCalibrated(), MLP())}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ArgumentError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    return METHODS[name]
