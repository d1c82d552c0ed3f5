"""What a server-side custom loss (trainer/losses/custom_graph.py) may call, and with what.

The allow-list: the functions by the qualified name the Tinker SDK sends (``torch.exp``,
``operator.mul``, ``math.sqrt``, ...), the torch.Tensor methods, the tensor attributes ``getattr``
may read, and the constants an argument may encode; each name maps to its callable in an
explicit dict (nothing is imported or looked up by a name from the wire). Nothing here
mutates: no in-place method, no ``out=``, ``inplace=True`` or ``setitem``.

The run-time rules of one call (``check_arguments``): Python operators take tensors and
numbers (no sequence arithmetic: ``[x] * 10**9``), integer powers stay within 2**53, math
functions take numbers, tensors are indexed by ints, slices, None, ``...`` and at most one
boolean mask (no integer-tensor indexing: on a GPU an index out of range is a device-side
assert that poisons the process), methods and attributes apply to tensors only. Then
``elements_bound`` bounds what the call will produce from its arguments' shapes, before it
runs, and ``check_value`` keeps every result a tensor, a bounded number, a
dtype, None, or a short tuple of these.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable

import torch

MAX_INT = 2**53  # Python integers a loss holds (constants and results)
MAX_SEQUENCE = 64  # the length of a tuple a call returns (a shape, torch.max's (values, indices))

OPERATORS: dict[str, Callable] = {  # Python arithmetic and comparisons on tensors and numbers
    "operator.add": operator.add, "operator.sub": operator.sub, "operator.mul": operator.mul,
    "operator.truediv": operator.truediv, "operator.floordiv": operator.floordiv, "operator.mod": operator.mod,
    "operator.pow": operator.pow, "operator.neg": operator.neg, "operator.pos": operator.pos,
    "operator.abs": operator.abs, "operator.lt": operator.lt, "operator.le": operator.le,
    "operator.gt": operator.gt, "operator.ge": operator.ge, "operator.eq": operator.eq, "operator.ne": operator.ne,
    "operator.and_": operator.and_, "operator.or_": operator.or_, "operator.xor": operator.xor,
    "operator.invert": operator.invert,
}
MATH: dict[str, Callable] = {  # on Python numbers (shapes, constants), never on tensors
    "math.sqrt": math.sqrt, "math.log": math.log, "math.log2": math.log2, "math.exp": math.exp,
    "math.log1p": math.log1p, "math.expm1": math.expm1, "math.floor": math.floor, "math.ceil": math.ceil,
    "math.fabs": math.fabs,
}
TORCH: dict[str, Callable] = {
    "torch.abs": torch.abs, "torch.neg": torch.neg, "torch.sign": torch.sign, "torch.exp": torch.exp,
    "torch.expm1": torch.expm1, "torch.log": torch.log, "torch.log1p": torch.log1p, "torch.log2": torch.log2,
    "torch.sqrt": torch.sqrt, "torch.rsqrt": torch.rsqrt, "torch.square": torch.square, "torch.pow": torch.pow,
    "torch.reciprocal": torch.reciprocal, "torch.sigmoid": torch.sigmoid, "torch.tanh": torch.tanh,
    "torch.relu": torch.relu, "torch.erf": torch.erf, "torch.logaddexp": torch.logaddexp,
    "torch.add": torch.add, "torch.sub": torch.sub, "torch.mul": torch.mul, "torch.div": torch.div,
    "torch.clamp": torch.clamp, "torch.clip": torch.clip, "torch.clamp_min": torch.clamp_min,
    "torch.clamp_max": torch.clamp_max, "torch.minimum": torch.minimum, "torch.maximum": torch.maximum,
    "torch.min": torch.min, "torch.max": torch.max, "torch.amin": torch.amin, "torch.amax": torch.amax,
    "torch.argmin": torch.argmin, "torch.argmax": torch.argmax, "torch.sum": torch.sum, "torch.mean": torch.mean,
    "torch.prod": torch.prod, "torch.std": torch.std, "torch.var": torch.var, "torch.logsumexp": torch.logsumexp,
    "torch.cumsum": torch.cumsum, "torch.softmax": torch.softmax, "torch.log_softmax": torch.log_softmax,
    "torch.count_nonzero": torch.count_nonzero, "torch.all": torch.all, "torch.any": torch.any,
    "torch.where": torch.where, "torch.masked_fill": torch.masked_fill, "torch.nan_to_num": torch.nan_to_num,
    "torch.isfinite": torch.isfinite, "torch.isnan": torch.isnan, "torch.lt": torch.lt, "torch.le": torch.le,
    "torch.gt": torch.gt, "torch.ge": torch.ge, "torch.eq": torch.eq, "torch.ne": torch.ne,
    "torch.logical_and": torch.logical_and, "torch.logical_or": torch.logical_or,
    "torch.logical_not": torch.logical_not, "torch.zeros_like": torch.zeros_like,
    "torch.ones_like": torch.ones_like, "torch.full_like": torch.full_like, "torch.stack": torch.stack,
    "torch.cat": torch.cat, "torch.reshape": torch.reshape, "torch.flatten": torch.flatten,
    "torch.squeeze": torch.squeeze, "torch.unsqueeze": torch.unsqueeze, "torch.numel": torch.numel,
    "torch.detach": torch.detach,
    "torch.nn.functional.relu": torch.nn.functional.relu, "torch._C._nn.softplus": torch.nn.functional.softplus,
    "torch._C._nn.log_sigmoid": torch.nn.functional.logsigmoid,
    "torch.nn.functional.softmax": torch.nn.functional.softmax,
    "torch.nn.functional.log_softmax": torch.nn.functional.log_softmax,
}
_T = torch.Tensor
METHODS: dict[str, Callable] = {  # torch.Tensor methods (call_method), none in-place
    "abs": _T.abs, "neg": _T.neg, "sign": _T.sign, "exp": _T.exp, "expm1": _T.expm1, "log": _T.log,
    "log1p": _T.log1p, "log2": _T.log2, "sqrt": _T.sqrt, "rsqrt": _T.rsqrt, "square": _T.square, "pow": _T.pow,
    "reciprocal": _T.reciprocal, "sigmoid": _T.sigmoid, "tanh": _T.tanh, "relu": _T.relu,
    "logaddexp": _T.logaddexp, "add": _T.add, "sub": _T.sub, "mul": _T.mul, "div": _T.div, "clamp": _T.clamp,
    "clip": _T.clip, "clamp_min": _T.clamp_min, "clamp_max": _T.clamp_max, "minimum": _T.minimum,
    "maximum": _T.maximum, "min": _T.min, "max": _T.max, "amin": _T.amin, "amax": _T.amax, "argmin": _T.argmin,
    "argmax": _T.argmax, "sum": _T.sum, "mean": _T.mean, "prod": _T.prod, "std": _T.std, "var": _T.var,
    "logsumexp": _T.logsumexp, "cumsum": _T.cumsum, "softmax": _T.softmax, "log_softmax": _T.log_softmax,
    "count_nonzero": _T.count_nonzero, "all": _T.all, "any": _T.any, "where": _T.where,
    "masked_fill": _T.masked_fill, "nan_to_num": _T.nan_to_num, "isfinite": _T.isfinite, "isnan": _T.isnan,
    "lt": _T.lt, "le": _T.le, "gt": _T.gt, "ge": _T.ge, "eq": _T.eq, "ne": _T.ne, "logical_and": _T.logical_and,
    "logical_or": _T.logical_or, "logical_not": _T.logical_not, "detach": _T.detach, "clone": _T.clone,
    "contiguous": _T.contiguous, "float": _T.float, "double": _T.double, "half": _T.half,
    "bfloat16": _T.bfloat16, "long": _T.long, "int": _T.int, "bool": _T.bool, "to": _T.to, "type_as": _T.type_as,
    "size": _T.size, "numel": _T.numel, "dim": _T.dim, "reshape": _T.reshape, "view": _T.view,
    "view_as": _T.view_as, "flatten": _T.flatten, "squeeze": _T.squeeze, "unsqueeze": _T.unsqueeze,
}
ATTRIBUTES: dict[str, Callable[[torch.Tensor], Any]] = {  # getattr(tensor, name): x.shape, ...
    "shape": lambda t: t.shape, "ndim": lambda t: t.ndim, "dtype": lambda t: t.dtype,
}
GETITEM, GETATTR = "operator.getitem", "getattr"
FUNCTIONS: dict[str, Callable] = {**OPERATORS, **MATH, **TORCH, GETITEM: operator.getitem}
# fx records ``x.shape`` as call_function ``getattr`` (x, "shape"): it runs as ATTRIBUTES["shape"](x)

# The constants an argument may encode ({"dtype": "float32"}, ...); {"device": ...} is refused.
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
          "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}
CONSTANTS = {"dtype": DTYPES, "layout": {"strided": torch.strided},
             "memory_format": {"contiguous_format": torch.contiguous_format, "preserve_format": torch.preserve_format}}
FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
ENCODED = ("ref", "tuple", "dict", "slice", "ellipsis", "float", *CONSTANTS)
STRING_KWARGS = {"rounding_mode": {"floor", "trunc"}}  # the only strings a call may take
REFUSED_KWARGS = {"out": "writes into an existing tensor", "device": "moves a tensor off its device",
                  "requires_grad": "changes what autograd tracks", "pin_memory": "allocates host memory",
                  "generator": "draws random numbers"}


def walk(value: Any):  # noqa: ANN201 - a generator
    """Every leaf of a decoded value (containers opened)."""
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from walk(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from walk(v)
    elif isinstance(value, slice):
        yield from walk((value.start, value.stop, value.step))
    else:
        yield value


def is_number(value: Any) -> bool:
    return isinstance(value, (bool, int, float))


def check_static(args: tuple, kwargs: dict) -> None:
    """A call's decoded arguments, before anything runs: no refused keyword, no ``inplace=True``,
    strings only where ``STRING_KWARGS`` allows one; ValueError saying what is wrong."""
    for key, value in kwargs.items():
        if key in REFUSED_KWARGS:
            raise ValueError(f"keyword {key!r} is not allowed ({REFUSED_KWARGS[key]})")
        if key == "inplace" and value is not False:
            raise ValueError("inplace=True is not allowed (a custom loss changes no tensor)")
        if isinstance(value, str) and value not in STRING_KWARGS.get(key, ()):
            raise ValueError(f"string argument {key}={value!r} is not allowed; allowed: {STRING_KWARGS}")
    nested = [v for v in kwargs.values() if not isinstance(v, str)]
    if any(isinstance(v, str) for v in walk((args, nested))):
        raise ValueError(f"string arguments are not allowed here (only {sorted(STRING_KWARGS)} take one)")


def check_arguments(op: str, target: str, args: tuple) -> None:
    """The run-time type rules of the operators, math, getitem, methods and attributes (module doc)."""
    if op == "call_method" or target == GETATTR:
        if not isinstance(args[0], torch.Tensor):
            raise ValueError(f"is called on a {type(args[0]).__name__}; only tensors have allowed methods/attributes")
    elif target in OPERATORS:
        if not all(isinstance(a, torch.Tensor) or is_number(a) for a in args):
            raise ValueError(f"takes tensors and numbers only, got {[type(a).__name__ for a in args]}")
        if target == "operator.pow" and all(isinstance(a, int) for a in args):  # a float overflows by itself
            base, exp = args
            if abs(base) > 1 and exp > 0 and exp * math.log2(abs(base)) > 53:
                raise ValueError(f"{base} ** {exp} exceeds 2**53")
    elif target in MATH:
        if not all(is_number(a) for a in args):
            raise ValueError("math functions take Python numbers only (use the torch function on a tensor)")
    elif target == GETITEM:
        _check_index(*args)
    elif target == "torch.where" and len(args) == 1:
        raise ValueError("torch.where(condition) (one index tensor per dimension) is not allowed; "
                         "use torch.where(condition, x, y)")


def _check_index(container: Any, index: Any) -> None:
    parts = index if isinstance(index, tuple) else (index,)
    if isinstance(container, (tuple, list)):  # torch.Size and torch.return_types are tuples
        if not all(isinstance(p, int) or (isinstance(p, slice) and all(v is None or isinstance(v, int) for v in
                                                                          (p.start, p.stop, p.step))) for p in parts):
            raise ValueError(f"indexes a {type(container).__name__} with {type(index).__name__}; use ints or slices")
        return
    if not isinstance(container, torch.Tensor):
        raise ValueError(f"indexes a {type(container).__name__}; only tensors, shapes and tuples are indexed")
    masks = 0
    for p in parts:
        if isinstance(p, torch.Tensor):
            if p.dtype != torch.bool:
                raise ValueError(f"indexes a tensor with a {p.dtype} tensor; only boolean masks index by tensor "
                                 "(an out-of-range integer index on a GPU is a device-side assert)")
            masks += 1
        elif isinstance(p, slice):
            if not all(v is None or isinstance(v, int) for v in (p.start, p.stop, p.step)):
                raise ValueError("slice bounds must be ints or None")
        elif not (p is None or p is Ellipsis or (isinstance(p, int) and not isinstance(p, bool))):
            raise ValueError(f"index part {type(p).__name__} is not allowed; use ints, slices, None, ... or one mask")
    if masks > 1:
        raise ValueError("at most one boolean mask per index")


def elements(value: Any) -> int:
    """The elements of a call's result (a tensor, or a tuple of them; numbers count 0)."""
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (tuple, list)):
        return sum(elements(v) for v in value)
    return 0


def elements_bound(target: str, args: tuple, kwargs: dict) -> int:
    """At most how many elements an allowed call of these arguments produces, from the shapes of its
    tensor arguments alone (nothing runs, nothing is allocated). Every allowed callable gives at most
    as many elements as the broadcast of its tensor arguments or their total (stack, cat), in at most
    two tensors (``torch.max(x, dim)``'s values and indices); test_custom_loss_graph checks this on
    every allowed callable. The broadcast is taken position by position (the widest size at each
    position), so shapes that do not broadcast get a bound too (the call then fails)."""
    if target == GETATTR:
        return 0  # shape, ndim, dtype
    if target == GETITEM and not isinstance(args[0], torch.Tensor):
        return elements(args[0])  # an element of an existing tuple (nothing new)
    shapes = [v.shape for v in walk((args, kwargs)) if isinstance(v, torch.Tensor)]
    if not shapes:
        return 0
    rank = max(len(s) for s in shapes)
    padded = [(1,) * (rank - len(s)) + tuple(s) for s in shapes]
    broadcast = math.prod(max(sizes) for sizes in zip(*padded))
    return 2 * max(broadcast, sum(math.prod(s) for s in shapes))


def check_value(value: Any, depth: int = 0) -> None:
    """A call's result is a tensor, None, a bool, a float, a dtype, an int within MAX_INT, or a short
    flat tuple of these; ValueError otherwise."""
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, (bool, float, torch.dtype)):
        return
    if isinstance(value, int):
        if abs(value) > MAX_INT:
            raise ValueError(f"produced the integer {value}, outside [-2**53, 2**53]")
        return
    if isinstance(value, (tuple, list)) and depth == 0 and len(value) <= MAX_SEQUENCE:
        for v in value:
            check_value(v, 1)
        return
    raise ValueError(f"produced a {type(value).__name__}, which a custom loss may not hold")


# What a call of an allowed function may raise on bad input (reported as the node's ValueError).
OP_ERRORS = (RuntimeError, TypeError, ValueError, IndexError, ZeroDivisionError, OverflowError, NotImplementedError)
