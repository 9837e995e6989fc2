"""mpjax: automatic mixed precision for JAX.

* `autocast`: a function transform that runs matrix products in float16 or
  bfloat16 and numerically fragile operations in float32.
* `grad_scaler`: dynamic loss scaling as an optax transform.
* `audit`: what ran in which precision.
* `diagnose`: where a 16-bit training step overflows or underflows.
"""

from mpjax._autocast import autocast
from mpjax.audit import AuditReport, Equation, audit
from mpjax.diagnose import DiagnoseReport, diagnose
from mpjax.policy import Rule, rule_for
from mpjax.scaler import (
    GradScalerState,
    SubtreeFlags,
    get_scale,
    grad_scaler,
    noop_scaler,
    scaled_value_and_grad,
    scaler_stats,
    set_scale,
    static_scaler,
)

__version__ = "0.1.0"

__all__ = [
    # autocast
    "autocast",
    "audit",
    "AuditReport",
    "Equation",
    "diagnose",
    "DiagnoseReport",
    "Rule",
    "rule_for",
    # loss scaling
    "grad_scaler",
    "static_scaler",
    "noop_scaler",
    "GradScalerState",
    "SubtreeFlags",
    "get_scale",
    "set_scale",
    "scaled_value_and_grad",
    "scaler_stats",
]
