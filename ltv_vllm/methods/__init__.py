"""Task-vector methods behind one interface (`base.Method`): the paper's LTV and the
baselines it is compared with. A new method is one module here and one `register(...)` line
in `registry.py`: it declares its options (the CLI's flags), its plot colour and what it
supports; extract, evaluate, compile and the plots find it there.

  ltv   LTV: ridge map h_zs → h_icl − h_zs, before the LM head           (ltv.py)
  ltv-auto  LTV with λ by closed-form leave-one-out error                 (ltv.py)
  kernel    RBF kernel ridge (closed form, dual), γ and λ by LOO           (ltv.py, kernel.py)
  mean  constant mapping c* = mean(h_icl − h_zs)                          (ltv.py)
  mlp   ReLU MLP map trained with MSE on the same pairs                   (mlp.py)
  tv    Task Vector: a layer's last-token state, replaced                 (tv.py)
  fv    Function Vector: top heads by indirect effect, added at a layer   (fv.py)
  sv    State Vector: separator attention states in the first layers      (sv.py)
  i2cl  I2CL: attention / MLP context vectors at every layer and token    (i2cl.py)
  i2cl-cal  I2CL with its coefficients calibrated on the demos             (i2cl.py)
"""

from __future__ import annotations

from ltv_vllm.methods.artifact import Artifact, load_artifact
from ltv_vllm.methods.base import Context, Method, MethodError, MethodOptions, Option
from ltv_vllm.methods.registry import METHODS, check_options_apply, get_method, register
from ltv_vllm.methods.score import MethodScores, inference_cost, score_methods

__all__ = ["METHODS", "Artifact", "Context", "Method", "MethodError", "MethodOptions",
           "MethodScores", "Option", "check_options_apply", "get_method", "inference_cost",
           "load_artifact", "register", "score_methods"]
