"""The registry: method name → its one instance. Adding a method is one module and one
`register(...)` line here."""

from __future__ import annotations

from ltv_vllm.errors import ArgumentError
from ltv_vllm.methods.base import COMMON, DECLARED, Method, MethodOptions, declare
from ltv_vllm.methods.fv import FV
from ltv_vllm.methods.i2cl import I2CL, I2CLCalibrated
from ltv_vllm.methods.ltv import LTV, KernelLTV, LTVAuto, Mean
from ltv_vllm.methods.ltv_layer import LayerLTV
from ltv_vllm.methods.mlp import MLP
from ltv_vllm.methods.sv import SV
from ltv_vllm.methods.tv import TV

METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Make `method` known to extract, evaluate, the CLI's flags and the plots."""
    if not method.name or method.name in METHODS:
        raise ArgumentError(f"method name {method.name!r} is empty or taken")
    declare(method.options, method.name)
    METHODS[method.name] = method
    return method


for _m in (LTV(), LTVAuto(), KernelLTV(), Mean(), TV(), FV(), SV(), I2CL(), I2CLCalibrated(),
           MLP(), LayerLTV()):
    register(_m)


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ArgumentError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    return METHODS[name]


def check_options_apply(methods: list[str], opts: MethodOptions) -> None:
    """Refuse a knob set away from its default that none of `methods` reads (`--rank` with
    --method kernel): it would be silently ignored."""
    common = {o.name for o in COMMON}
    own = {o.name for name in methods if name in METHODS for o in METHODS[name].options}
    for name, value in opts.to_dict().items():
        if name in common or name in own or value == DECLARED[name].default:
            continue
        owner = [m.name for m in METHODS.values() if any(o.name == name for o in m.options)]
        raise ArgumentError(f"{DECLARED[name].flag} is an option of {', '.join(owner)}, "
                            f"not of {', '.join(methods)}")
