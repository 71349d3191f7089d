"""ferrite's ops as PyTorch custom ops (``torch.library.custom_op``).

Each op checks its inputs (device, dtype, shapes) in Python, allocates its outputs with torch (so
the caching allocator and CUDA-graph capture see ordinary allocations), and hands ferrite raw
descriptors ``(data_ptr, shape, strides, dtype)`` plus the device index and torch's current CUDA
stream, so the kernels run on torch's stream and write into torch's tensors.

Ops (``torch.ops.ferrite.*``), each with a fake (meta) implementation and, for the forward ones,
autograd whose backward is its own custom op:

- ``matmul(a, b)``: ``a @ b`` for ``a [..., m, k]`` and ``b [k, n]`` or ``b [..., k, n]`` with the
  same batch dims (or a 2-D ``a`` broadcast over them).  Backward: ``matmul_backward``, two matmuls.
- ``linear(x, weight, bias)``: ``x @ weight.T + bias`` (``torch.nn.functional.linear``); the bias
  is added by the GEMM itself (``out = bias; out = x·Wᵀ + 1·out``).  Backward: ``linear_backward``.
- ``rms_norm(x, normalized_shape, weight, eps) -> (y, rstd)`` and
  ``layer_norm(x, normalized_shape, weight, bias, eps) -> (y, mean, rstd)``: the saved statistics
  are float32, one per row.  Backward: ``rms_norm_backward`` / ``layer_norm_backward`` (ferrite's
  norm backward, with dweight/dbias reduced deterministically).

The Python functions :func:`matmul`, :func:`linear`, :func:`rms_norm`, :func:`layer_norm` have the
signatures of their ``torch`` / ``torch.nn.functional`` counterparts and return one tensor.

Layout policy: inputs that the kernels cannot take as they are are **copied**
(``.contiguous()``), as torch's own ops do: matmul takes row-major and transposed operands
(stride 1 in one of the last two dims) without a copy and copies anything else; the norms copy
any non-contiguous input.  The native layer itself never copies on CUDA and raises ``ValueError``
on a layout it cannot take.

Dtypes: float32, float16, bfloat16 on CUDA (sm_80+); on the CPU, matmul/linear run float32 only
and the norms run all three.  float64 is not supported (gradcheck runs in float32).

The ops live in the modules beside this one, one group each: ``_ops_common`` (dtype names, the
argument checks, descriptors and the native call, activation names), ``_ops_matmul``,
``_ops_linear`` (linear, linear_rows, linear_act), ``_ops_mlp``, ``_ops_norm`` (rms_norm,
layer_norm, add_norm) and ``_ops_functional`` (the public functions). This module imports them in
that order, which registers the ops in that order, and re-exports their names: ``_ops.NAME`` is
the namespace the rest of the package uses. Assigning ``_ops.NAME = ...`` rebinds the name here
only; to change a module-level setting (``_PAD_MIN_ELEMS``, ``_CUDA_LINEAR_VARIANT``) assign it on
the module that defines it.
"""

from . import _native  # noqa: F401
from ._eager import eager  # noqa: F401
from ._ops_common import (  # noqa: F401
    _ACT_NAMES, _activation, _ACTIVATIONS, _check_tensors, _desc, _DESC_NAMES, _describe, _DTYPE_NAMES,
    _empty, _fail, _FLOATS, _native_call, _raw_stream, _tf32, _torch_act, _where,
)
from ._ops_matmul import (  # noqa: F401
    _check_cpu_matmul_dtype, _matmul, _matmul_backward, _matmul_bwd, _matmul_grads, _matmul_setup,
    _matmul_shape, _mm_into, _mm_operand,
)
from ._ops_linear import (  # noqa: F401
    _aligned_rows, _CUDA_LINEAR_VARIANT, _linear, _linear_act, _linear_act_backward, _linear_act_bwd,
    _linear_act_setup, _linear_backward, _linear_bwd, _linear_grads, _linear_grads_fake, _linear_rows,
    _linear_run, _linear_setup, _linear_shape, _PAD_MIN_ELEMS, _padded_width, _rows2, _rows_strides,
)
from ._ops_mlp import (  # noqa: F401
    _mlp, _mlp_backward, _mlp_bwd, _mlp_grads, _mlp_setup, _mlp_shapes,
)
from ._ops_norm import (  # noqa: F401
    _add_norm, _add_norm_bwd, _add_norm_check, _add_norm_setup, _layer_norm, _layer_norm_backward,
    _ln_bwd, _ln_setup, _norm_backward, _norm_check, _norm_fake, _norm_forward, _norm_run, _norm_shape,
    _rms_bwd, _rms_norm, _rms_norm_backward, _rms_setup,
)
from ._ops_functional import (  # noqa: F401
    add_layer_norm, add_rms_norm, cuda_status, layer_norm, linear, linear_rows, matmul, mlp, rms_norm,
)
