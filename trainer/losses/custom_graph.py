"""Server-side custom losses: the Tinker SDK's traced loss (``CustomLossGraph``) rebuilt from an
allow-list of torch, math and operator functions, and run per datum with the SDK's semantics.

The wire (tinker 0.38, ``ServiceClient.create_custom_loss``): the user's per-datum function
``fn(logprobs, *inputs) -> (loss, metrics)`` is traced by torch.fx on the client and sent as
plain data: ``inputs`` ``[{"name": "logprobs", "rank": 1}, {"name": <loss_fn_inputs key>,
"rank": 0|1|2}, ...]`` (``logprobs`` first, then the keys ``fn`` reads, in its parameter
order) and ``graph`` ``{"format": 1, "nodes": [{op, name, target, args, kwargs}, ...]}`` (each
node as torch.fx records it; args encoded as the SDK's ``CustomLossNode`` docstring says:
``{"ref": name}``, ``{"tuple": [...]}``, ``{"dict": {...}}``, ``{"slice": [a, b, c]}``,
``{"ellipsis": true}``, ``{"float": "inf"}``, ``{"dtype": "float32"}``, ...).

Contract (what the trainer calls; every error is a ValueError that names the node, its target
and what is allowed, and changes nothing):

* ``compile_custom_loss(name, inputs, graph) -> CustomLoss``: the static checks, once per loss
  (at ``/api/v1/create_custom_loss``). ``logprobs`` must have rank 1: this server computes the
  log-probability of one target token per position (``target_tokens`` [N]).
* ``CustomLoss.check_datum(n, loss_fn_inputs)``: before the pass, per datum of ``n`` tokens: the
  inputs the loss names are present with their declared ranks, and a dry run on CPU with
  ``logprobs = 0`` (requiring grad) passes: the loss is a 0-dim floating tensor that depends on
  ``logprobs``, every metric one number. Python numbers in a graph never depend on tensor values
  (no ``item()``, ``float(t)``, ``bool(t)``), so after the dry run a datum can still fail only
  through a data-dependent shape (boolean-mask indexing).
* ``CustomLoss.datum(logprobs, loss_fn_inputs) -> (loss, metrics)``: one datum; ``logprobs``
  [N] floating (differentiable), the inputs tensors on the same device (keys the loss does not
  read are ignored). An input declared rank 0 may come as a one-element [1] tensor and is
  read as its 0-dim value: the SDK's protobuf writes no shape for a rank-0 tensor, which
  api/tinker/proto_io.py reads as [1] (the SDK checked the rank client-side). ``loss``: the graph's 0-dim loss (differentiable); ``metrics``:
  ``{"custom/<x>:sum"|"custom/<x>:mean": detached 0-dim tensor or number}``.
* ``combine_metrics(datum_losses, datum_metrics) -> dict[str, float]``: the call's metrics,
  as the SDK combines them (``run_loss_handle``): ``loss:sum`` the sum of the datums' losses,
  each ``:sum`` metric summed over datums, each ``:mean`` metric summed and divided by the
  number of datums. (The SDK's chunk combiner weights a chunk's ``:mean`` by its datum count,
  so a call the SDK splits into chunks gets the same numbers.)
* ``call_loss(loss, logprobs, loss_fn_inputs) -> (loss, metrics)``: one forward_backward call
  (one list entry per datum): the SUM of the datums' losses (0-dim, backpropagate it) and
  ``combine_metrics`` of them. ``datum`` + ``combine_metrics`` are the same thing for a runner
  that computes each datum's loss in its own micro-batch.

Why interpret the node list instead of building a torch.fx GraphModule: a GraphModule runs by
generating Python source and ``exec``-ing it, and a guard is needed between nodes anyway (the
memory bound below, the value checks, an error that names the node); the interpreter is that
loop, over callables taken from explicit dicts: nothing is imported, looked up or evaluated by
a name from the wire.

Bounds: at most ``MAX_NODES`` nodes, ``MAX_ARG_DEPTH`` levels and ``MAX_ARG_ITEMS`` values in
one node's arguments, strings of ``MAX_STR_LEN`` characters, integer constants within
``MAX_INT``; at run time the tensors one datum's nodes produce hold at most
``max_value_elements`` in all, checked BEFORE each node runs from its arguments' shapes (an
upper bound: custom_ops.elements_bound), then counted exactly. What may be called, with what (no mutation, no integer-tensor indexing, no device
arguments, no tensor factories that take sizes), and the run-time rules of each call:
trainer/losses/custom_ops.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from trainer.losses.custom_ops import (ATTRIBUTES, CONSTANTS, ENCODED, FLOATS, FUNCTIONS, GETATTR, MAX_INT, METHODS,
                                       OP_ERRORS, check_arguments, check_static, check_value, elements,
                                       elements_bound, is_number)

MAX_NODES = 256
MAX_INPUTS = 16
MAX_ARG_DEPTH = 6  # the output's (loss, {metric: ref}) is 3 levels
MAX_ARG_ITEMS = 64
MAX_STR_LEN = 64
MAX_VALUE_ELEMENTS = 2**26  # 256 MiB of float32, at most 512 MiB in any allowed dtype

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")  # the SDK's rule for parameters
_METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")  # the SDK's rule


@dataclass(frozen=True)
class _Ref:
    name: str  # an earlier node's name


@dataclass(frozen=True)
class _Step:
    name: str
    op: str  # call_function | call_method
    target: str
    fn: Callable
    args: tuple
    kwargs: dict

    def where(self, loss: str) -> str:
        return f"custom loss {loss!r}: node {self.name!r} ({self.op} {self.target!r})"


# -- decoding: the wire's encoded arguments -> Python values with _Ref for nodes ---------------------


@dataclass
class _Decoder:
    where: str  # "custom loss 'x': node 'y' (op 'target')", for messages
    known: set[str]  # the names of the nodes before this one
    items: int = 0

    def error(self, problem: str) -> ValueError:
        return ValueError(f"{self.where}: {problem}")

    def decode(self, value: Any, depth: int = 1) -> Any:
        self.items += 1
        if self.items > MAX_ARG_ITEMS:
            raise self.error(f"its arguments hold more than {MAX_ARG_ITEMS} values (a custom loss's constants are small)")
        if depth > MAX_ARG_DEPTH:
            raise self.error(f"its arguments nest deeper than {MAX_ARG_DEPTH} levels")
        if value is None or isinstance(value, (bool, float)):
            return value
        if isinstance(value, int):
            if abs(value) > MAX_INT:
                raise self.error(f"integer constant {value} is outside [-2**53, 2**53]")
            return value
        if isinstance(value, str):
            if len(value) > MAX_STR_LEN:
                raise self.error(f"a string constant is longer than {MAX_STR_LEN} characters")
            return value
        if isinstance(value, list):
            return [self.decode(v, depth + 1) for v in value]
        if not (isinstance(value, dict) and len(value) == 1):
            raise self.error(f"an argument of type {type(value).__name__} is not an encoded value; "
                             f"allowed: JSON scalars, lists and one-key objects {list(ENCODED)}")
        ((kind, body),) = value.items()
        return self._decode_object(kind, body, depth)

    def _decode_object(self, kind: str, body: Any, depth: int) -> Any:
        if kind == "ref":
            if not (isinstance(body, str) and body in self.known):
                raise self.error(f"{{'ref': {str(body)[:MAX_STR_LEN]!r}}} names no earlier node")
            return _Ref(body)
        if kind == "tuple" and isinstance(body, list):
            return tuple(self.decode(v, depth + 1) for v in body)
        if kind == "dict" and isinstance(body, dict):
            for key in body:
                self.decode(key, depth + 1)  # a key is a bounded string
            return {key: self.decode(v, depth + 1) for key, v in body.items()}
        if kind == "slice" and isinstance(body, list) and len(body) == 3:
            return slice(*(self.decode(v, depth + 1) for v in body))
        if kind == "ellipsis" and body is True:
            return Ellipsis
        if kind == "float" and body in FLOATS:
            return FLOATS[body]
        if kind == "device":
            raise self.error("device arguments are not allowed: a custom loss computes where its inputs are")
        if kind in CONSTANTS and body in CONSTANTS[kind]:
            return CONSTANTS[kind][body]
        allowed = {k: sorted(v) for k, v in CONSTANTS.items()}
        raise self.error(f"{{{kind!r}: {str(body)[:MAX_STR_LEN]!r}}} is not an allowed encoded value; allowed kinds: "
                         f"{list(ENCODED)}, with {allowed}, float in {sorted(FLOATS)}")


# -- compiling: the static checks ---------------------------------------------------------------------


@dataclass(frozen=True)
class CustomLoss:
    """A checked custom loss: its inputs (name, rank), its steps, and its output refs."""

    name: str
    inputs: tuple[tuple[str, int], ...]  # ("logprobs", 1) first
    placeholders: tuple[str, ...]  # the node name bound to each input, in order
    steps: tuple[_Step, ...]
    loss_ref: _Ref
    metric_refs: dict[str, _Ref]
    max_value_elements: int = MAX_VALUE_ELEMENTS

    def check_datum(self, n: int, loss_fn_inputs: dict[str, torch.Tensor]) -> None:
        """Ranks and a dry run on CPU (module doc): raises ValueError, changes nothing."""
        for key, rank in self.inputs[1:]:
            if key not in loss_fn_inputs:
                raise ValueError(f"loss_fn_inputs lacks {key!r}, which custom loss {self.name!r} takes "
                                 f"(it takes {[k for k, _ in self.inputs[1:]]})")
            got = _as_rank(loss_fn_inputs[key], rank).dim()
            if got != rank:
                raise ValueError(f"loss_fn_inputs[{key!r}] has rank {got}, but custom loss {self.name!r} declared "
                                 f"rank {rank}")
        logprobs = torch.zeros(n, dtype=torch.float32, requires_grad=True)
        self.datum(logprobs, {k: v.detach().cpu() for k, v in loss_fn_inputs.items()})

    def datum(self, logprobs: torch.Tensor, loss_fn_inputs: dict[str, torch.Tensor]
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        """One datum's (loss, metrics) (module doc)."""
        if logprobs.dim() != 1 or not logprobs.is_floating_point():
            raise ValueError(f"custom loss {self.name!r}: logprobs must be a floating [N] tensor, "
                             f"got {logprobs.dtype} {tuple(logprobs.shape)}")
        env: dict[str, Any] = {self.placeholders[0]: logprobs}
        for node_name, (key, rank) in zip(self.placeholders[1:], self.inputs[1:]):
            if key not in loss_fn_inputs:
                raise ValueError(f"loss_fn_inputs lacks {key!r}, which custom loss {self.name!r} takes")
            env[node_name] = _as_rank(loss_fn_inputs[key], rank)
        budget = _Budget(self.max_value_elements, self.max_value_elements)
        for step in self.steps:
            env[step.name] = _run_node(step, self.name, env, budget)
        return self._outputs(env, logprobs.requires_grad)

    def _outputs(self, env: dict[str, Any], needs_grad: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        loss = env[self.loss_ref.name]
        where = f"custom loss {self.name!r}"
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
            got = f"{loss.dtype} {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"{where} must return a 0-dim floating tensor as its loss, got {got}")
        if needs_grad and not loss.requires_grad:
            raise ValueError(f"{where}: its loss does not depend on logprobs (no gradient would reach the model)")
        metrics = {}
        for key, ref in self.metric_refs.items():
            value = env[ref.name]
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.detach().reshape(())
            elif not is_number(value):
                raise ValueError(f"{where}: metric {key!r} must be one number (a 1-element tensor), got "
                                 f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}")
            metrics[key] = value
        return loss, metrics


def _as_rank(value: torch.Tensor, rank: int) -> torch.Tensor:
    """A rank-0 input sent through the protobuf wire arrives as [1] (module doc): its 0-dim view."""
    return value.reshape(()) if rank == 0 and value.dim() == 1 and value.numel() == 1 else value


def compile_custom_loss(name: str, inputs: list[dict], graph: dict, *,
                        max_value_elements: int = MAX_VALUE_ELEMENTS) -> CustomLoss:
    """The request's ``inputs`` and ``graph`` (plain data) checked and rebuilt; ValueError otherwise."""
    name = str(name)[:128]
    where = f"custom loss {name!r}"
    input_pairs = _check_inputs(where, inputs)
    if not isinstance(graph, dict) or graph.get("format") != 1 or set(graph) - {"format", "nodes"}:
        raise ValueError(f"{where}: graph must be {{'format': 1, 'nodes': [...]}}")
    nodes = graph.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise ValueError(f"{where}: graph has no nodes")
    if len(nodes) > MAX_NODES:
        raise ValueError(f"{where}: graph has {len(nodes)} nodes; a custom loss may have at most {MAX_NODES}")
    known: set[str] = set()
    placeholders, steps, output = [], [], None
    for i, node in enumerate(nodes):
        op, node_name, target = _check_node_fields(where, i, node, known)
        at = f"{where}: node {node_name!r} ({op} {target!r})"
        if output is not None:
            raise ValueError(f"{at} comes after the output node; the output node is the last")
        if op == "placeholder":
            if steps or len(placeholders) == len(input_pairs) or target != input_pairs[len(placeholders)][0]:
                raise ValueError(f"{at}: the placeholders must come first and name the inputs in order "
                                 f"{[k for k, _ in input_pairs]}")
            if node.get("args") or node.get("kwargs"):
                raise ValueError(f"{at}: a placeholder takes no arguments (no defaults)")
            placeholders.append(node_name)
        else:
            decoder = _Decoder(at, known)
            args = tuple(decoder.decode(a) for a in _as(at, node.get("args", []), list, "args"))
            kwargs = {decoder.decode(k): decoder.decode(v) for k, v in _as(at, node.get("kwargs", {}), dict, "kwargs").items()}
            if op == "output":
                output = _check_output(at, args, kwargs)
            else:
                steps.append(_check_call(at, node_name, op, target, args, kwargs))
        known.add(node_name)
    if len(placeholders) != len(input_pairs):
        raise ValueError(f"{where}: graph has {len(placeholders)} placeholders for {len(input_pairs)} inputs")
    if output is None:
        raise ValueError(f"{where}: graph has no output node")
    return CustomLoss(name, tuple(input_pairs), tuple(placeholders), tuple(steps), output[0], output[1],
                      max_value_elements)


def _check_inputs(where: str, inputs: Any) -> list[tuple[str, int]]:
    rule = (f"inputs must be [{{'name': 'logprobs', 'rank': 1}}, then one {{'name', 'rank'}} per loss_fn_inputs key "
            f"(lowercase names, ranks 0, 1 or 2)], at most {MAX_INPUTS} in all")
    if not (isinstance(inputs, list) and 0 < len(inputs) <= MAX_INPUTS):
        raise ValueError(f"{where}: {rule}")
    pairs = []
    for item in inputs:
        if not (isinstance(item, dict) and set(item) == {"name", "rank"} and isinstance(item["name"], str)
                and _INPUT_NAME.fullmatch(item["name"]) and item["rank"] in (0, 1, 2)
                and not isinstance(item["rank"], bool)):
            raise ValueError(f"{where}: input {str(item)[:100]} is not allowed; {rule}")
        pairs.append((item["name"], int(item["rank"])))
    names = [n for n, _ in pairs]
    if names[0] != "logprobs" or "logprobs" in names[1:] or len(set(names)) != len(names):
        raise ValueError(f"{where}: got inputs {names}; {rule}")
    if pairs[0][1] != 1:
        raise ValueError(f"{where}: logprobs has rank {pairs[0][1]}; this server computes one target token's "
                         "log-probability per position (target_tokens [N]), so logprobs has rank 1")
    return pairs


def _check_node_fields(where: str, i: int, node: Any, known: set[str]) -> tuple[str, str, str]:
    if not (isinstance(node, dict) and {"op", "name", "target"} <= set(node) <= {"op", "name", "target", "args", "kwargs"}):
        raise ValueError(f"{where}: node {i} must be {{op, name, target, args, kwargs}}")
    op, node_name, target = node["op"], node["name"], node["target"]
    if not (isinstance(node_name, str) and _NAME.fullmatch(node_name)) or node_name in known:
        raise ValueError(f"{where}: node {i}'s name {str(node_name)[:MAX_STR_LEN]!r} must be a new identifier "
                         "of at most 64 characters")
    if not (isinstance(target, str) and len(target) <= 128):
        raise ValueError(f"{where}: node {node_name!r}'s target must be a string of at most 128 characters")
    at = f"{where}: node {node_name!r} ({op} {target!r})"
    if op == "get_attr":
        raise ValueError(f"{at}: a custom loss may not read attributes or captured tensors; it reads only "
                         "logprobs and the loss_fn_inputs it names")
    if op == "call_module":
        raise ValueError(f"{at}: a custom loss may not call modules; only the allowed functions "
                         f"({sorted(FUNCTIONS)}) and tensor methods ({sorted(METHODS)})")
    if op not in ("placeholder", "call_function", "call_method", "output"):
        raise ValueError(f"{at}: op must be placeholder, call_function, call_method or output")
    return op, node_name, target


def _as(at: str, value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind):
        raise ValueError(f"{at}: {what} must be a {kind.__name__}")
    return value


def _check_call(at: str, node_name: str, op: str, target: str, args: tuple, kwargs: dict) -> _Step:
    if target == GETATTR and op == "call_function":
        if not (len(args) == 2 and not kwargs and isinstance(args[0], _Ref) and args[1] in ATTRIBUTES):
            raise ValueError(f"{at}: getattr is allowed only as tensor.<attribute> with attribute in "
                             f"{sorted(ATTRIBUTES)}, got arguments {str(args)[:100]}")
        return _Step(node_name, op, target, ATTRIBUTES[args[1]], args[:1], {})
    if op == "call_method":
        if target not in METHODS:
            raise ValueError(f"{at}: method {target!r} is not allowed; allowed tensor methods: {sorted(METHODS)}")
        if not args or not isinstance(args[0], _Ref):
            raise ValueError(f"{at}: a method call's first argument is the tensor it is called on (a node)")
        fn = METHODS[target]
    elif target not in FUNCTIONS:
        raise ValueError(f"{at}: function {target!r} is not allowed; a custom loss may call only "
                         f"{sorted(FUNCTIONS)}, and getattr for tensor attributes {sorted(ATTRIBUTES)}")
    else:
        fn = FUNCTIONS[target]
    try:
        check_static(args, kwargs)
    except ValueError as err:
        raise ValueError(f"{at}: {err}") from None
    return _Step(node_name, op, target, fn, args, kwargs)


def _check_output(at: str, args: tuple, kwargs: dict) -> tuple[_Ref, dict[str, _Ref]]:
    rule = "the output is (loss, {'custom/<name>:sum' or 'custom/<name>:mean': tensor, ...}), every value a node"
    if kwargs or len(args) != 1 or not (isinstance(args[0], (tuple, list)) and len(args[0]) == 2):
        raise ValueError(f"{at}: {rule}")
    loss, metrics = args[0]
    if not isinstance(loss, _Ref) or not isinstance(metrics, dict):
        raise ValueError(f"{at}: {rule}")
    for key, value in metrics.items():
        if not (isinstance(key, str) and _METRIC_KEY.fullmatch(key)) or not isinstance(value, _Ref):
            raise ValueError(f"{at}: metric {str(key)[:MAX_STR_LEN]!r} is not allowed; {rule} (lowercase names)")
    return loss, metrics


# -- running one node: guards, the memory bound, the call ---------------------------------------------


def _resolve(value: Any, env: dict[str, Any]) -> Any:
    if isinstance(value, _Ref):
        return env[value.name]
    if isinstance(value, list):
        return [_resolve(v, env) for v in value]
    if isinstance(value, tuple):
        return tuple(_resolve(v, env) for v in value)
    if isinstance(value, dict):
        return {k: _resolve(v, env) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_resolve(value.start, env), _resolve(value.stop, env), _resolve(value.step, env))
    return value


@dataclass
class _Budget:
    """The tensor elements the nodes of one datum's run may still produce."""

    left: int
    limit: int

    def refuse(self, count: int, when: str) -> ValueError:
        return ValueError(f"{when} {count} tensor elements, more than the {self.left} left of the {self.limit} "
                          "one datum's custom loss may produce")


def _run_node(step: _Step, loss: str, env: dict[str, Any], budget: _Budget) -> Any:
    """Run one node under its guards, within ``budget``."""
    args, kwargs = _resolve(step.args, env), _resolve(step.kwargs, env)
    try:
        check_arguments(step.op, step.target, args)
        bound = elements_bound(step.target, args, kwargs)
        if bound > budget.left:
            raise budget.refuse(bound, "could produce (bound from its arguments' shapes, before running) up to")
        value = step.fn(*args, **kwargs)
        check_value(value)
    except OP_ERRORS as err:
        raise ValueError(f"{step.where(loss)} failed: {err}") from None
    produced = elements(value)
    if produced > budget.left:
        raise ValueError(f"{step.where(loss)}: {budget.refuse(produced, 'produced')}")
    budget.left -= produced
    return value


# -- a call: the datums' losses summed, metrics by their suffix -----------------------------------------


def combine_metrics(datum_losses: list[torch.Tensor | float],
                    datum_metrics: list[dict[str, torch.Tensor | float]]) -> dict[str, float]:
    """``loss:sum`` and each ``custom/<x>:sum|mean`` over one call's datums (module doc)."""
    n = len(datum_losses)
    out = {"loss:sum": sum(_floats(datum_losses))}
    for key in (datum_metrics[0] if datum_metrics else {}):
        total = sum(_floats([m[key] for m in datum_metrics]))
        out[key] = total / n if key.endswith(":mean") else total
    return out


def _floats(values: list[torch.Tensor | float]) -> list[float]:
    """Python floats, with one device transfer for the tensors (not one per value)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    as_floats = iter(torch.stack([t.detach().reshape(()).double() for t in tensors]).tolist() if tensors else [])
    return [next(as_floats) if isinstance(v, torch.Tensor) else float(v) for v in values]


def call_loss(loss: CustomLoss, logprobs: list[torch.Tensor], loss_fn_inputs: list[dict[str, torch.Tensor]]
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """One forward_backward call: (sum of the datums' losses, combined metrics) (module doc)."""
    if not logprobs or len(logprobs) != len(loss_fn_inputs):
        raise ValueError(f"call_loss needs one loss_fn_inputs per logprobs, got {len(logprobs)} and {len(loss_fn_inputs)}")
    losses, metrics = zip(*(loss.datum(lp, inputs) for lp, inputs in zip(logprobs, loss_fn_inputs)))
    total = losses[0]
    for datum_loss in losses[1:]:
        total = total + datum_loss
    return total, combine_metrics([d.detach() for d in losses], list(metrics))
