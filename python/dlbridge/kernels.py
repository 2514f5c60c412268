"""One kernel, every mode: eager, inside ``jax.jit``, inside ``torch.compile``.

``kernel(fn, ...)`` wraps an extension's function (typically a ``#[pyfunction]`` taking typed
arguments) into one callable that

- called eagerly (numpy, torch, jax arrays, anything dlbridge imports) calls ``fn`` directly;
- called with jax tracers (inside ``jax.jit``, ``jax.vmap``, ``jax.grad``) lowers to an XLA FFI
  custom call of the handler ``ffi`` (a capsule the extension exports), its result shape and dtype
  taken from the declared output rule ``out``;
- called inside ``torch.compile`` (or eagerly on torch tensors that need a gradient) goes through a
  torch op, so dynamo traces it without a graph break: for a kernel with a handler, a native op
  registered through torch's stable C ABI (the handler its CPU kernel, the output rule its Meta
  kernel: no Python inside the op, which ``torch.export`` and AOTInductor packages call too);
  else, or where the process's torch lacks the stable functions, a ``torch.library.custom_op``
  whose fake implementation follows the same rule (why: ``_native_fallback``).

Gradients are right or refused, never silently wrong. ``backward`` names the gradient:
``(kernel, args, grads)``, where ``args`` are names among the parameters, ``"out"`` (the result) and
``"grad"`` (the result's cotangent), and ``grads`` the tensor parameters the backward kernel
returns gradients for (one result, or a tuple in that order); or any callable
``backward(named: dict) -> dict`` mapping parameter names to gradients. torch autograd uses it
through ``torch.library.register_autograd``, ``jax.grad`` as the transpose of the kernel's tangent
(below). A kernel without one is refused by both: jax raises that the FFI call cannot be
differentiated (or, for a kernel with a jvp, that it names no backward); torch raises at backward
(``no autograd formula``), as for its own custom ops, and an in-place kernel called with an
argument that requires grad (in grad mode) is refused at the call, since autograd cannot record
the write.

Forward mode: ``jvp`` names the result's tangent: ``(kernel, args)``, ``args`` among the
parameters, ``"out"`` and ``"tangent_<parameter>"`` (each tensor parameter's tangent, zeros where
none), the kernel returning the tangent; or a callable ``jvp(named: dict) -> tangent``. It must be
linear in the tangents. torch's forward AD (dual tensors, ``torch.func.jvp``, ``jacfwd``) calls it
through the kernel's ``autograd.Function`` (its ``jvp``); a kernel without one refuses a dual
tensor, which the eager function would drop. In jax a kernel with a backward or a jvp is a
``jax.custom_jvp`` whose tangent is one linear primitive (``_linear_call``): forward mode runs the
jvp, reverse mode its transpose, the backward; each missing one is refused, naming it. Second
order: ``jax.hessian`` and ``torch.func.hessian`` (forward over reverse) where the backward kernel
names a jvp, forward over forward where the jvp kernel does; "first order only" otherwise. A jvp
is for a kernel that writes no argument. A kernel with several results (``results``, below) gets
one tangent per result, residuals included, in their order (a tuple, from a jvp kernel with
``results`` of its own or a callable); the jvp reads each result by its name too. A residual
needs its tangent: the backward reads it, so forward over reverse (``hessian``) differentiates
through it (torch: a kernel with a jvp keeps its residuals differentiable in its
``autograd.Function``, their cotangents zero). The caller sees the visible results' tangents.

A backward is differentiable again (reverse over reverse) when it is made of differentiable
operations (torch ops, or kernels with a backward of their own); where it is not (a kernel
without a backward, a plain function), double backward (``create_graph=True``,
``gradgradcheck``) raises that the gradient is first order only.

``torch.func`` works too: ``vmap`` through the op's vmap rule (one call per batch element, the
results stacked), ``grad``, ``jacrev`` and ``vmap(grad)`` through an ``autograd.Function`` in
torch.func's style (``setup_context``) with the same backward, or the same refusal.

Several results: ``results`` names them, in the order the function returns them (a tuple) and the
handler writes them; ``result_rule(shapes, dtypes, attrs) -> [(shape, dtype), ...]`` gives each
one's shape and dtype from the tensor arguments' shapes and dtypes (numpy names), one entry per
tensor parameter (an optional one's None when absent, a list's a list of its items'), and the
attributes (``add_kernel`` makes it from ``KernelDef.results``' Rust rules). jax's ``ffi_call``
result types and the torch op's fake results come from it. Those named in ``residuals`` are saved
by the forward and handed to the backward (by name), never returned to the caller: the raw ops
underneath (the torch op, ``torch.ops.<namespace>.<name>``, and the XLA custom call) return every
result, residuals included, and the kernel returns the others (one tensor, or a tuple). The
backward reads each result by its name and each visible result's cotangent as ``grad_<name>``
(``out`` and ``grad``: the first visible result and its cotangent); a residual's cotangent is
always zero, since the caller never sees it (torch: marked non-differentiable).

Parameters named in ``attrs`` are XLA attributes (static under ``jax.jit``), each of its declared
type: a numpy scalar type (``"float32"``, ``"int64"``, ``"bool"``, ...; torch ``float``/``int``/``bool``
arguments), ``"str"`` (an XLA string attribute; torch ``str``), or an array ``"int64[]"``,
``"int32[]"``, ``"float32[]"``, ``"float64[]"``, ``"bool[]"`` (an XLA array attribute of that element
type, passed to ``ffi_call`` as a numpy array, a ``bool[]`` as uint8 bytes since XLA has no bool
array attribute; torch ``int[]``/``float[]``/``bool[]``). A str or
array value is checked at every call, in every mode, and a wrong one refused naming the attribute,
its declared type and the value; an array reaches the function (and a backward or jvp) as a tuple
of Python numbers. Every other parameter is a tensor. Parameters named in
``mutates`` are written in place: torch sees them as ``mutates_args``; XLA, being functional, gets
the first one as an input aliased to the output (``input_output_aliases``), and the jitted call
returns its new value (the handler reads and writes the aliased output buffer).

Parameters named in ``optional`` take a tensor or None (torch ``Tensor?``, ``=None`` when the
function's default is None); those in ``lists`` a list or tuple of tensors (``Tensor[]``). jax's
``ffi_call`` takes a flat list of operands, so under ``jax.jit`` a list's items go flat, a None
gives none, and each optional or list parameter adds an int64 attribute ``<name>.count`` (the
handler declares them: ``xla_handler!(fn h(call, operands: [tensor("x"), optional("bias")], ..))``).
A backward reads them as the function does (None, a list) and gives a list of gradients for a
list (one per item); an absent optional's gradient is None. Under ``torch.func`` transforms and
forward-mode AD, the ``autograd.Function`` takes each item of a list as an input of its own (flat,
with the lists' lengths), so ``grad``, ``jacrev``, ``vmap`` and, with a jvp, ``jvp``/``jacfwd`` see
them; a jvp reads a list's tangent as a list.

Names: the torch op is ``torch.ops.<namespace>.<name>`` and the XLA FFI target
``<namespace>.<name>``, named by ``name=`` and ``namespace=`` or, by default, the function's name
in the top-level package of its module (``my_kernels.rms_norm`` for ``my_kernels.my_kernels``'s
``rms_norm``). ``help(kernel)`` shows the signature, the function's docs, the op and the target.

A kernel's XLA FFI target is registered with jax when the kernel is made (or, made before jax is
imported, right after jax's own import), so a ``jax.export``-ed function that calls it runs in a
process that imported the extension, without tracing the kernel first.

Importing this module imports no array library: torch and jax are used only once the caller has
imported them.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
import numbers
import operator
import re
import sys
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any

__all__ = ["Kernel", "kernel"]

# Attribute types, and the torch schema type of each: scalars (numpy scalar type names), a string,
# and arrays (XLA array attributes of the element type; torch lists).
_ATTR_SCHEMA = {
    "float32": "float",
    "float64": "float",
    "int32": "int",
    "int64": "int",
    "bool": "bool",
    "str": "str",
    "int64[]": "int[]",
    "int32[]": "int[]",
    "float32[]": "float[]",
    "float64[]": "float[]",
    "bool[]": "bool[]",
}
_SCALAR_ATTRS = frozenset({"float32", "float64", "int32", "int64", "bool"})
_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def _attr_refusal(kernel: str, name: str, declared: str, value: Any, why: str = "") -> TypeError:
    hint = {
        "str": "pass a str",
        "bool[]": "pass a list of bools, e.g. [True, False]",
    }.get(declared)
    if hint is None:
        hint = "pass a list of ints, e.g. [0, 1]" if declared.startswith("int") else "pass a list of numbers, e.g. [0.5, 1.0]"
    tp = type(value).__name__
    return TypeError(
        f"{kernel}: attribute {name!r} is declared {declared!r}, but the call passed {_article(tp)} "
        f"{tp} ({value!r}){why}: {hint}"
    )


def _attr_value(kernel: str, name: str, declared: str, value: Any, compiled: bool = False) -> Any:
    """A str or array attribute's value checked against its declared type: the str itself, or
    the array as a tuple of Python numbers (hashable: jax keeps it static). A value of another
    type (a list for a str, a float or a bool in an int array, a str for an array) is refused,
    naming the attribute, its declared type and the value; never converted silently.

    ``compiled``: traced by dynamo, where a numpy scalar element is a traced array (its value
    unknown until run): it is handed to the op as it is, which takes it as torch's own custom
    ops do (their schema checks it), rather than refused for a type it only has while traced."""
    if declared == "str":
        if not isinstance(value, str):
            raise _attr_refusal(kernel, name, declared, value)
        # (A lone surrogate: XLA's and torch's strings are UTF-8, which cannot hold one.)
        if not value.isascii() and any(0xD800 <= ord(c) <= 0xDFFF for c in value):
            raise _attr_refusal(kernel, name, declared, value, " (not UTF-8 encodable: a lone surrogate)")
        return value
    # (A set has no order: refused as torch's list schema refuses it.)
    if isinstance(value, (str, bytes, Mapping, Set)) or getattr(value, "ndim", 1) != 1:
        raise _attr_refusal(kernel, name, declared, value, " (an array attribute is one sequence of values)")
    # A number is refused before list() is tried (torch 2.11's dynamo cannot trace list(1): it
    # would report that instead of the refusal).
    if isinstance(value, numbers.Number):
        raise _attr_refusal(kernel, name, declared, value)
    try:
        items = list(value)
    except TypeError:
        raise _attr_refusal(kernel, name, declared, value) from None
    out: list[Any] = []
    traced = False
    ints = declared in ("int64[]", "int32[]")
    floats = declared in ("float64[]", "float32[]")
    lo, hi = _INT32 if declared == "int32[]" else _INT64
    for i, e in enumerate(items):
        tp = type(e)
        # A Python int, float or bool where it belongs needs no ABC check (the usual element).
        if (tp is int and ints) or (tp is float and floats) or (tp is bool and not ints and not floats):
            ok, v = True, e
        elif compiled and tp.__name__ == "ndarray":
            out.append(e)
            traced = True
            continue
        else:
            bool_like = tp.__name__ in ("bool", "bool_")
            if not ints and not floats:
                ok = bool_like
                v = bool(e) if ok else None
            elif ints:
                ok = isinstance(e, numbers.Integral) and not bool_like
                v = int(e) if ok else None
            else:
                ok = isinstance(e, numbers.Real) and not bool_like
                try:
                    v = float(e) if ok else None
                except OverflowError:  # an int past float64's range
                    raise _attr_refusal(kernel, name, declared, value, f" (element {i} does not fit a float64)") from None
            if not ok:
                raise _attr_refusal(
                    kernel, name, declared, value, f" (element {i} is {_article(tp.__name__)} {tp.__name__}, {e!r})"
                )
        if ints and not lo <= v <= hi:  # type: ignore[operator]
            raise _attr_refusal(kernel, name, declared, value, f" (element {i}, {v}, does not fit an {declared[:-2]})")
        out.append(v)
    # (A list where an element is traced: dynamo hands a list's numpy scalars to the op as
    # numbers, as it does for torch's own custom ops; a tuple of them reaches the op as tensors.)
    return out if traced else tuple(out)


def _schema_default(declared: str, value: Any) -> str | None:
    """An attribute's default as torch's schema writes it (None: it cannot say it)."""
    if declared in _SCALAR_ATTRS:
        return repr(value)
    try:
        value = _attr_value("", "", declared, value)
    except TypeError:
        return None
    if declared == "str":
        if any(ord(c) < 32 or ord(c) == 127 for c in value):
            return None
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if declared.startswith("float") and not all(math.isfinite(v) for v in value):
        return None
    return "[" + ", ".join(repr(v) for v in value) + "]"
# What torch.ops accepts as a namespace or op name, and the namespaces torch keeps for itself.
_IDENTIFIER = re.compile(r"[A-Za-z][0-9A-Za-z_]*")
_RESERVED_NAMESPACES = frozenset({"prim", "prims", "aten", "at", "torch", "pytorch"})
_EMPTY = inspect.Parameter.empty
_UNSET = object()

# What each argument type is, found once per type: 0 plain, 1 a jax tracer, 2 a torch tensor,
# 4 a torch tensor subclass (and, per call, 8: a torch tensor that requires grad).
# A list or tuple (16) is looked into (a kernel's list-of-tensors argument): its items' routes count.
_ROUTE: dict[type, int] = {list: 16, tuple: 16}
# FFI targets already registered with jax (name -> capsule), and the kernels whose torch op or jax
# target waits for torch's or jax's import.
_JAX_TARGETS: dict[str, Any] = {}
_TARGET_NAMES: set[str] = set()
_PENDING_TORCH: list[Kernel] = []
_PENDING_JAX: list[Kernel] = []
# A kernel declared from Rust with an XLA handler (dlbridge::python::add_kernel) can be a native
# torch op: its ffi capsule -> the private Rust function that defines the op through torch's
# stable C ABI, called once, when the kernel's torch op is made (see _native_torch_op).
_NATIVE_OPS: dict[Any, Callable[..., str | None]] = {}
# A kernel declared from Rust whose XLA handler makes a state at XLA's instantiate stage
# (xla_handler!'s `state:`): its ffi capsule -> the stage bundle jax registers instead,
# {"instantiate": capsule, "execute": capsule} (dlbridge::python::add_kernel sets it).
_FFI_BUNDLES: dict[Any, dict[str, Any]] = {}


def _no_grad_mode() -> bool:
    """The grad mode until torch is imported (before torch, nothing needs a gradient)."""
    return False


class _NoForwardAD:
    """torch.autograd.forward_ad's level until torch is imported: no dual level is open."""

    _current_level = -1


# torch._C.is_grad_enabled and torch.autograd.forward_ad once torch is imported: module globals, so
# an eager call on torch tensors pays one C call (a tensor requires grad) or one attribute read
# (is a dual level open) to learn whether autograd must see it.
_grad_enabled: Callable[[], bool] = _no_grad_mode
_forward_ad: Any = _NoForwardAD


def _no_functorch_level() -> None:
    """torch.func's current transform level until torch is imported: none."""
    return None


# torch._C._functorch.maybe_current_level once torch is imported: None outside torch.func's
# transforms (one C call on the op path).
_functorch_level: Callable[[], Any] = _no_functorch_level


def _torch_seen(torch: Any) -> None:
    global _grad_enabled, _forward_ad, _functorch_level
    _grad_enabled = torch._C.is_grad_enabled
    _forward_ad = torch.autograd.forward_ad
    _functorch_level = torch._C._functorch.maybe_current_level


def _identifier(text: str) -> str:
    """``text`` as a name torch.ops accepts (letters, digits, underscores, a letter first)."""
    ident = re.sub(r"[^0-9A-Za-z_]", "_", text).lstrip("_")
    return ident if ident[:1].isalpha() else f"k_{ident}"


def _route_of(tp: type) -> int:
    route = 0
    jax = sys.modules.get("jax")
    if jax is not None and issubclass(tp, jax.core.Tracer):
        route = 1
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(tp, torch.Tensor):
        # Plain tensors (and parameters) are called eagerly; subclasses (fake and functional
        # tensors while torch.compile's AOTAutograd traces a backward, user subclasses) always
        # go through the custom op.
        route = 2 if tp is torch.Tensor or tp is torch.nn.Parameter else 4
        _torch_seen(torch)
    # The answer never changes: a class's bases are fixed when it is made, so a type that exists
    # before jax or torch is imported cannot be a subclass of theirs.
    _ROUTE[tp] = route
    return route


def _route(args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    """Where a kernel call goes, from its arguments' types (the bits of ``_ROUTE``): 1 a jax
    tracer, 2 a plain torch tensor, 8 added when it requires grad, 4 a torch subclass, 16 a list
    or tuple (whose items ``Kernel._route_with_items`` then counts); 0 for none of them."""
    route = 0
    for a in (*args, *kwargs.values()) if kwargs else args:
        r = _ROUTE.get(type(a))
        if r is None:
            r = _route_of(type(a))
        if r == 2 and a.requires_grad:
            r = 10
        route |= r
    return route


class _Out:
    """The output rule: like a tensor parameter, or a callable over the tensor arguments."""

    __slots__ = ("like", "rule")

    def __init__(self, like: int | None, rule: Callable[..., tuple[Sequence[int], str]] | None):
        self.like = like
        self.rule = rule


class Kernel:
    """A kernel callable in every mode (see the module's documentation)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        namespace: str | None = None,
        out: str | Callable[..., tuple[Sequence[int], str]] | None = _UNSET,  # type: ignore[assignment]
        attrs: Mapping[str, str] | None = None,
        mutates: Sequence[str] = (),
        ffi: Any = None,
        backward: Any = None,
        vmap_method: str = "sequential",
        results: Sequence[str] | None = None,
        residuals: Sequence[str] = (),
        result_rule: Callable[..., Sequence[tuple[Sequence[int], str]]] | None = None,
        jvp: Any = None,
        optional: Sequence[str] = (),
        lists: Sequence[str] = (),
    ) -> None:
        self._fn = fn
        for what, given in (("name", name), ("namespace", namespace)):
            if given is not None and not _IDENTIFIER.fullmatch(given):
                raise ValueError(
                    f"kernel: {what}={given!r} is not a valid op {what}: use letters, digits and "
                    "underscores, starting with a letter (it names torch.ops.<namespace>.<name> and the "
                    "XLA FFI target <namespace>.<name>)"
                )
        if namespace in _RESERVED_NAMESPACES:
            raise ValueError(f"kernel: namespace={namespace!r} is reserved by torch: choose another")
        self.__name__: str = name or str(getattr(fn, "__name__", "kernel"))
        self.__qualname__ = self.__name__
        self.__wrapped__ = fn
        module = getattr(fn, "__module__", None) or "extension"
        self.__module__ = module
        # The op's names, chosen by the author or derived: the name is the kernel's (the
        # function's) name, the namespace the top-level package of the function's module.
        self._named = name is not None or namespace is not None
        self._op_name = name if name is not None else _identifier(self.__name__)
        if namespace is None:
            namespace = _identifier(module.split(".")[0])
            if namespace in _RESERVED_NAMESPACES:
                namespace += "_kernels"
        self._namespace = namespace
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError) as e:
            raise TypeError(f"kernel: cannot read the parameters of {fn!r} ({e})") from None
        self._params: tuple[str, ...] = tuple(sig.parameters)
        self._defaults: tuple[Any, ...] = tuple(p.default for p in sig.parameters.values())
        self._index = {n: i for i, n in enumerate(self._params)}
        attrs = dict(attrs or {})
        for n, t in attrs.items():
            if n not in self._index:
                raise ValueError(f"kernel {self.__name__}: attrs names {n!r}, not a parameter")
            if t not in _ATTR_SCHEMA:
                raise ValueError(
                    f"kernel {self.__name__}: attribute {n!r} has type {t!r} "
                    f"(allowed: {', '.join(_ATTR_SCHEMA)})"
                )
        self._attrs = attrs
        self._tensor_idx = tuple(i for i, n in enumerate(self._params) if n not in attrs)
        self._attr_idx = tuple(i for i, n in enumerate(self._params) if n in attrs)
        # The str and array attributes: checked (and arrays made tuples) at every call, in every
        # mode; a kernel with scalar attributes only pays nothing for them.
        self._checked_idx = tuple(i for i in self._attr_idx if attrs[self._params[i]] not in _SCALAR_ATTRS)
        self._declare_counted(attrs, mutates, optional, lists)
        # The array attributes, which torch's op hands its implementation and autograd as lists:
        # made tuples there, as every other mode passes them.
        self._array_idx = frozenset(i for i in self._checked_idx if attrs[self._params[i]] != "str")
        for n in mutates:
            if n not in self._index or n in attrs:
                raise ValueError(f"kernel {self.__name__}: mutates names {n!r}, not a tensor parameter")
        self._mutates = tuple(mutates)
        self._mutated_idx = self._index[mutates[0]] if mutates else None
        # Several results: their names, which are residuals, and which the caller sees.
        self._results: tuple[str, ...] = ()
        self._residuals: tuple[str, ...] = ()
        self._visible: tuple[int, ...] = ()
        self._result_rule = result_rule
        if results is not None:
            self._declare_results(out, results, residuals, result_rule)
            out = self._params[self._tensor_idx[0]] if self._tensor_idx else None
        elif residuals or result_rule is not None:
            raise ValueError(f"kernel {self.__name__}: residuals= and result_rule= need results=")
        if out is _UNSET:
            out = None if mutates else self._params[self._tensor_idx[0]]
        if results is not None:
            self._out = _Out(None, None)
            self._returns = True
        elif out is None:
            if not mutates:
                raise ValueError(f"kernel {self.__name__}: a kernel that writes no argument needs out=")
            self._out = _Out(self._mutated_idx, None)
            self._returns = False
        elif callable(out):
            self._out = _Out(None, out)
            self._returns = True
        else:
            like = out.removeprefix("like ").strip()
            if like not in self._index or like in attrs:
                raise ValueError(f"kernel {self.__name__}: out={out!r} names no tensor parameter")
            if like in self._optional or like in self._lists:
                kind = "an optional tensor (it may be None)" if like in self._optional else "a list of tensors"
                raise ValueError(
                    f"kernel {self.__name__}: out={out!r}: {like!r} is {kind}, so it cannot give the "
                    "result's shape and dtype: name a tensor parameter, or give a rule (a callable)"
                )
            self._out = _Out(self._index[like], None)
            self._returns = True
        if mutates and self._returns and self._out.like != self._mutated_idx:
            raise ValueError(f"kernel {self.__name__}: an in-place kernel's result is its argument {mutates[0]!r}")
        self._ffi = ffi
        # One XLA FFI target per kernel, <namespace>.<name>: a kernel made twice gets a second
        # name where its names are derived; a name the author chose is never changed (a
        # serialized jax.export names it), so a second kernel of that name is refused.
        target = base = f"{self._namespace}.{self._op_name}"
        copy = 1
        while target in _TARGET_NAMES:
            if self._named:
                raise ValueError(
                    f"kernel {self.__name__}: the XLA FFI target {target!r} is taken by another kernel "
                    "of this process: give this one another name= or namespace="
                )
            copy += 1
            target = f"{base}_{copy}"
        _TARGET_NAMES.add(target)
        self._target = target
        if backward is not None and not callable(backward):
            bk, bargs, bgrads = backward
            # The results by name, and their cotangents.
            declared: tuple[str, ...] = self._results
            known = {"out", "grad", *declared, *[f"grad_{n}" for n in declared]}
            for n in bargs:
                if n not in self._index and n not in known:
                    raise ValueError(f"kernel {self.__name__}: backward argument {n!r} is unknown")
            for n in bgrads:
                if n not in self._index or n in attrs:
                    raise ValueError(f"kernel {self.__name__}: backward gradient {n!r} is no tensor parameter")
            backward = (bk, tuple(bargs), tuple(bgrads))
            if isinstance(bk, Kernel):
                # Its refusal of a double backward then names this kernel (first order only).
                bk._grad_of.append(str(self.__name__))
        self._backward = backward
        self._jvp = self._declare_jvp(jvp)
        self.__doc__ = self._help(getattr(fn, "__doc__", None))
        self.__signature__ = self._signature()
        # The kernels this one is the named backward, or the named jvp, of.
        self._grad_of: list[str] = []
        self._jvp_of: list[str] = []
        if jvp is not None and not callable(jvp) and isinstance(jvp[0], Kernel):
            jvp[0]._jvp_of.append(str(self.__name__))
        self._vmap_method = vmap_method
        self._op: Any = None
        # torch.compiler.is_compiling once torch is there: an attribute of the instance, since
        # under dynamo each name read on the way is a guard checked at every compiled call.
        self._compiling: Callable[[], bool] = _never_compiling
        self._overload: Any = None
        # The autograd kernel of a native in-place op without a backward (kept alive here).
        self._autograd_lib: Any = None
        self._jax_ad: Any = None
        self._func: Any = None
        if "torch" in sys.modules:
            self._make_torch_op(sys.modules["torch"])
            _make_pending_torch_ops()
        else:
            _PENDING_TORCH.append(self)
            _watch_import("torch")
        if ffi is not None:
            # Registered now (or right after jax's import), not at the first traced call: a
            # jax.export-ed function calling this kernel may be deserialized and run by a
            # process that never traces it.
            _PENDING_JAX.append(self)
            if _jax_imported() is not None:
                _register_pending_jax_targets()
            else:
                _watch_import("jax")
        if self._results:
            # The caller sees the visible results only (one kernel class per shape of return, so
            # a kernel with one result pays nothing for this): one, or a tuple of several.
            self._pick = _picker(self._visible)
            self.__class__ = _SeveralResults
        if self._checked_idx:
            # str and array attributes checked at every call, in every mode (a class of its own,
            # so a kernel without them reads nothing more per call, nor guards on it compiled).
            self.__class__ = _checked_class(self.__class__)

    def _declare_counted(
        self, attrs: Mapping[str, str], mutates: Sequence[str], optional: Sequence[str], lists: Sequence[str]
    ) -> None:
        """The optional tensor parameters (``Tensor?``: a tensor or None) and the lists of tensors
        (``Tensor[]``), checked; ``_kinds`` gives each tensor parameter's kind (0 a tensor, 1
        optional, 2 a list), in the order of ``_tensor_idx``."""
        name = self.__name__
        if isinstance(optional, str) or isinstance(lists, str):
            raise ValueError(f"kernel {name}: optional= and lists= take a sequence of parameter names, not a string")
        for what, names in (("optional", optional), ("lists", lists)):
            for n in names:
                if n not in self._index or n in attrs:
                    raise ValueError(f"kernel {name}: {what} names {n!r}, not a tensor parameter")
                if n in mutates:
                    raise ValueError(f"kernel {name}: {what} names {n!r}, which mutates writes in place (one tensor)")
        both = set(optional) & set(lists)
        if both:
            raise ValueError(f"kernel {name}: {', '.join(map(repr, sorted(both)))} is named in optional and lists: one kind each")
        self._optional: tuple[str, ...] = tuple(optional)
        self._lists: tuple[str, ...] = tuple(lists)
        self._kinds: tuple[int, ...] = tuple(
            1 if self._params[i] in self._optional else 2 if self._params[i] in self._lists else 0
            for i in self._tensor_idx
        )
        # Whether any tensor parameter is optional or a list: the calls that pass operands flat
        # (jax's ffi_call) then add a count attribute "<parameter>.count" for each.
        self._counted = any(self._kinds)
        # The list parameters' indices (torch.func's autograd.Function takes their items flat).
        self._list_idx = frozenset(i for i, n in enumerate(self._params) if n in self._lists)

    def _flatten(self, vals: Sequence[Any]) -> tuple[list[Any], tuple[tuple[str, int], ...]]:
        """The tensor arguments of ``vals`` (one per parameter) as a flat list (a list's items in
        order, an absent optional left out) and the count attribute of each optional or list
        parameter; a None for a parameter that is not optional, or a list parameter given
        another thing, refused in the author's terms."""
        flat: list[Any] = []
        counts: list[tuple[str, int]] = []
        for i, k in zip(self._tensor_idx, self._kinds, strict=True):
            v, n = vals[i], self._params[i]
            if k == 0:
                if v is None:
                    self._refuse_none(n)
                flat.append(v)
            elif k == 1:
                if v is not None:
                    flat.append(v)
                counts.append((f"{n}.count", 0 if v is None else 1))
            else:
                if not isinstance(v, (list, tuple)):
                    raise TypeError(
                        f"{self.__name__}: argument {n!r} is a list of tensors (lists={list(self._lists)}): "
                        f"pass a list or tuple of tensors, not {type(v).__name__}"
                    )
                for e in v:
                    if e is None:
                        self._refuse_none_items(n, v)
                flat.extend(v)
                counts.append((f"{n}.count", len(v)))
        return flat, tuple(counts)

    def _refuse_none(self, n: str) -> None:
        raise TypeError(
            f"{self.__name__}: argument {n!r} is None, but the kernel declares {n!r} a tensor, not an "
            f"optional one: pass a tensor, or declare it optional (dlbridge.kernels.kernel(..., "
            f'optional=[{n!r}]), Rust: KernelDef {{ optional: &["{n}"], .. }})'
        )

    def _unflatten(self, flat: Sequence[Any], counts: Any) -> list[Any]:
        """``flat`` (as ``_flatten`` makes it) back into one value per tensor parameter, in the
        order of ``_tensor_idx``: a tensor, a tensor or None (optional), a list (a list). ``counts``:
        the count attributes (pairs or a mapping; other attributes ignored)."""
        if not self._counted:
            return list(flat)
        known = dict(counts)
        out: list[Any] = []
        at = 0
        for i, k in zip(self._tensor_idx, self._kinds, strict=True):
            if k == 0:
                out.append(flat[at])
                at += 1
                continue
            c = int(known[f"{self._params[i]}.count"])
            if k == 1:
                out.append(flat[at] if c else None)
            else:
                out.append(list(flat[at : at + c]))
            at += c
        return out

    def _flat_grads(self, per_param: Sequence[Any], like: Sequence[Any], zeros: Callable[[Any], Any]) -> list[Any]:
        """Gradients given one per tensor parameter (a list's a sequence, an absent optional's
        None) as the flat list ``_flatten`` makes of ``like`` (the arguments, one per parameter),
        each missing one zeros like its argument."""
        flat: list[Any] = []
        for k, g, x in zip(self._kinds, per_param, like, strict=True):
            if k == 2:
                gs = list(g) if g is not None else [None] * len(x)
                if len(gs) != len(x):
                    raise ValueError(f"{self.__name__}: the backward gave {len(gs)} gradients for a list of {len(x)} tensors")
                flat.extend(zeros(t) if d is None else d for d, t in zip(gs, x, strict=True))
            elif x is None:
                continue
            else:
                flat.append(zeros(x) if g is None else g)
        return flat

    def _declare_jvp(self, jvp: Any) -> Any:
        """The forward-mode rule, checked: ``(kernel, args)`` (``args`` names among the
        parameters, ``"out"``, each result's name and ``"tangent_<parameter>"``) or a callable
        ``jvp(named) -> tangent`` (a tuple of one tangent per result, for several)."""
        if jvp is None:
            return None
        name = self.__name__
        if self._mutates:
            raise ValueError(f"kernel {name}: jvp= with mutates=: an in-place kernel has no derivative")
        if callable(jvp):
            return jvp
        try:
            jk, jargs = jvp
        except (TypeError, ValueError):
            raise ValueError(
                f"kernel {name}: jvp={jvp!r}: give (kernel, args) or a callable jvp(named) -> tangent"
            ) from None
        tensors = [self._params[i] for i in self._tensor_idx]
        known = {"out", *tensors, *self._attrs, *self._results, *[f"tangent_{n}" for n in tensors]}
        for n in jargs:
            if n not in known:
                results = "".join(f"{r!r}, " for r in self._results)
                raise ValueError(
                    f"kernel {name}: jvp argument {n!r} is unknown (a parameter, 'out', {results}or "
                    f"'tangent_<tensor parameter>': {', '.join(f'tangent_{t}' for t in tensors)})"
                )
        return (jk, tuple(jargs))

    def _declare_results(
        self, out: Any, results: Sequence[str], residuals: Sequence[str], rule: Any
    ) -> None:
        name = self.__name__
        if out is not _UNSET and out is not None:
            raise ValueError(f"kernel {name}: out={out!r} and results=: declare the results in one of them")
        if self._mutates:
            raise ValueError(f"kernel {name}: results= with mutates=: a kernel with several results writes no argument")
        if not callable(rule):
            raise ValueError(f"kernel {name}: results= needs result_rule=, each result's shape and dtype")
        names: tuple[str, ...] = tuple(results)
        if not names:
            raise ValueError(f"kernel {name}: results=() names no result")
        for n in names:
            if not isinstance(n, str) or not _IDENTIFIER.fullmatch(n):
                raise ValueError(f"kernel {name}: result name {n!r}: letters, digits and underscores, a letter first")
            if n in self._index or n in ("out", "grad") or n.startswith("grad_") or names.count(n) > 1:
                raise ValueError(f"kernel {name}: result name {n!r} is taken (a parameter, out, grad, grad_*, or twice)")
        for n in residuals:
            if n not in names:
                raise ValueError(f"kernel {name}: residuals names {n!r}, not one of results {names}")
        visible = tuple(i for i, n in enumerate(names) if n not in residuals)
        if not visible:
            raise ValueError(f"kernel {name}: every result is a residual; the caller needs one")
        self._results = names
        self._residuals = tuple(residuals)
        self._visible = visible

    def _result_types(self, tensors: Sequence[Any], attrs: Mapping[str, Any]) -> list[tuple[tuple[int, ...], str]]:
        """Each result's (shape, dtype name) by the result rule, for arrays or tensors (fake ones
        included), one per tensor parameter: a tensor, an optional one's None when absent, a
        list's list (the rule reads each as such)."""

        def shape(t: Any) -> tuple[int, ...]:
            return tuple(int(d) for d in t.shape)

        def dtype(t: Any) -> str:
            return str(t.dtype).removeprefix("torch.")

        if self._counted:
            shapes: list[Any] = []
            dtypes: list[Any] = []
            for k, t in zip(self._kinds, tensors, strict=True):
                if k == 2:
                    shapes.append([shape(e) for e in t])
                    dtypes.append([dtype(e) for e in t])
                elif t is None:
                    shapes.append(None)
                    dtypes.append(None)
                else:
                    shapes.append(shape(t))
                    dtypes.append(dtype(t))
        else:
            shapes = [shape(t) for t in tensors]
            dtypes = [dtype(t) for t in tensors]
        rule = self._result_rule
        assert rule is not None  # results= needs it (checked at declaration)
        made = list(rule(shapes, dtypes, dict(attrs)))
        if len(made) != len(self._results):
            raise ValueError(
                f"{self.__name__}: result_rule gave {len(made)} results, the kernel declares {len(self._results)}"
            )
        return [(self._checked_extents(r, shape), str(dtype)) for r, (shape, dtype) in zip(self._results, made)]

    def _checked_extents(self, result: str, shape: Any) -> tuple[int, ...]:
        """A result's shape as the rule gave it, each extent an integer of at least 0 and their
        product within int64, else an error naming the kernel and the result (as the Rust rules'
        are checked): XLA aborts the process on an element count past int64, and torch and jax
        refuse a negative extent naming neither."""
        try:
            if isinstance(shape, (str, bytes)) or any(isinstance(d, bool) for d in shape):
                raise TypeError
            dims = tuple(operator.index(d) for d in shape)
        except TypeError:
            raise ValueError(
                f"{self.__name__}: result {result}: result_rule gave the shape {shape!r}: a shape is a "
                "sequence of integers"
            ) from None
        if any(d < 0 for d in dims):
            raise ValueError(f"{self.__name__}: result {result}: result_rule gave the shape {dims}, a negative extent")
        if math.prod(dims) >= 2**63:
            raise ValueError(
                f"{self.__name__}: result {result}: result_rule gave the shape {dims}, whose element count "
                "overflows a 64-bit integer"
            )
        return dims

    def _all_results(self, outs: Any) -> tuple[Any, ...]:
        """``outs``, what the function returned, if it is a tuple of every declared result (else a
        clear error: indexing a single array would silently give its rows). A kernel declaring one
        result may return it alone: torch's op does (a schema ``-> (Tensor)`` returns a Tensor)."""
        if len(self._results) == 1 and type(outs) is not tuple:
            return (outs,)
        if type(outs) is not tuple or len(outs) != len(self._results):
            got = f"a tuple of {len(outs)}" if type(outs) is tuple else type(outs).__name__
            raise TypeError(
                f"{self.__name__}: the function returned {got}, but the kernel declares "
                f"{len(self._results)} results ({', '.join(self._results)}): return them all, as a tuple in that order"
            )
        return outs

    def _named_results(self, named: dict[str, Any], outs: Sequence[Any], grads: Sequence[Any]) -> None:
        """What a backward reads of the results: each by name, each cotangent as grad_<name>,
        ``out`` and ``grad`` the first visible result's."""
        for r, o, g in zip(self._results, outs, grads, strict=True):
            named[r] = o
            named[f"grad_{r}"] = g
        first = self._visible[0]
        named["out"] = outs[first]
        named["grad"] = grads[first]

    def __repr__(self) -> str:
        return f"<dlbridge kernel {self._namespace}.{self._op_name}>"

    def _signature(self) -> inspect.Signature:
        """The parameters as the kernel reads them: tensors (``Tensor``, or ``Tensor (written in
        place)``) and attributes (their numpy type), with their defaults."""
        params = []
        for i, n in enumerate(self._params):
            if n in self._attrs:
                note = self._attrs[n]
            elif n in self._mutates:
                note = "Tensor (written in place)"
            elif n in self._optional:
                note = "Tensor | None"
            elif n in self._lists:
                note = "list[Tensor]"
            else:
                note = "Tensor"
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
            params.append(inspect.Parameter(n, kind, default=self._defaults[i], annotation=note))
        # An in-place kernel returns the argument it writes.
        result = "Tensor" if self._mutated_idx is None else f"Tensor ({self._mutates[0]})"
        if self._results:
            shown = [f"Tensor {self._results[i]}" for i in self._visible]
            result = shown[0] if len(shown) == 1 else f"({', '.join(shown)})"
        return inspect.Signature(params, return_annotation=result)

    def _help(self, doc: str | None) -> str:
        """What ``help(kernel)`` shows: the signature, the author's docs, then where the kernel
        runs (its torch op and XLA FFI target) and its gradient."""
        sig = str(self._signature()).replace("'", "")
        lines = [f"{self.__name__}{sig}", ""]
        if doc:
            lines += [inspect.cleandoc(doc), ""]
        ns, name = self._namespace, self._op_name
        lines.append(
            f"A dlbridge kernel: eager on numpy, torch and jax arrays; torch.ops.{ns}.{name} under "
            f"torch.compile and autograd; XLA FFI target {self._target!r} under jax.jit"
            + ("" if self._ffi is not None else " (no handler: jax tracers are refused)")
            + "."
        )
        if self._attrs:
            lines.append(
                "Attributes (static under jax.jit): "
                + ", ".join(f"{n}: {t}" for n, t in self._attrs.items())
                + "."
            )
        if self._mutates:
            lines.append(f"Writes {', '.join(self._mutates)} in place.")
        if self._results:
            lines.append(
                f"Results: {', '.join(self._results)}"
                + (f"; residuals (saved for the backward, never returned): {', '.join(self._residuals)}" if self._residuals else "")
                + "."
            )
        bw = self._backward
        if bw is None:
            lines.append("No backward: gradients through it are refused.")
        elif callable(bw):
            lines.append(f"Backward: {getattr(bw, '__name__', bw)!s}.")
        else:
            bk, bargs, bgrads = bw
            lines.append(
                f"Backward: {getattr(bk, '__name__', bk)!s}({', '.join(bargs)}) gives the gradient of "
                f"{', '.join(bgrads)}."
            )
        jv = self._jvp
        if jv is None:
            lines.append("No jvp: forward-mode derivatives through it are refused.")
        elif callable(jv):
            lines.append(f"Jvp: {getattr(jv, '__name__', jv)!s}.")
        else:
            of = f"the tangents of {', '.join(self._results)}" if self._results else "the tangent of the result"
            lines.append(f"Jvp: {getattr(jv[0], '__name__', jv[0])!s}({', '.join(jv[1])}) gives {of}.")
        return "\n".join(lines)

    @property
    def namespace(self) -> str:
        """The op's namespace: ``torch.ops.<namespace>.<name>``, XLA FFI target
        ``<namespace>.<name>`` (the author's, or the top-level package of the function's module)."""
        return self._namespace

    @property
    def op_name(self) -> str:
        """The op's name in its namespace (the author's, or the kernel's name)."""
        return self._op_name

    @property
    def target(self) -> str:
        """The XLA FFI target name (registered with jax when the kernel is made, or right after
        jax's import)."""
        return self._target

    @property
    def torch_op(self) -> Any:
        """The kernel's torch op (None until torch is imported): the native op
        (``torch.ops.<namespace>.<name>``, an ``OpOverloadPacket``) for a kernel with a handler,
        else the ``torch.library`` custom op."""
        self._sync_torch()
        return self._op

    # --- dispatch ---

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Inside torch.compile dynamo traces this method: what it reads here becomes guards
        # checked at every call of the compiled function, so the path reads little (the op binds
        # the arguments itself, defaults included).
        if self._compiling():
            if _forward_ad._current_level >= 0:
                # Forward-mode AD (torch.func.jvp, jacfwd, dual tensors) under torch.compile: the
                # op's autograd has no jvp, so the compiled graph would drop the tangent (a silent
                # zero; dynamo drops an autograd.Function's jvp too). The call runs eagerly, through
                # the kernel's jvp: a graph break, which fullgraph=True refuses naming the kernel.
                return self._eager_forward_ad(*args, **kwargs)
            # A Python number where the op takes a tensor (a scalar parameter missing from
            # `attrs`): said in the author's terms, not the schema's. Dynamo knows each argument's
            # type, so this costs no guard unless a number is passed (then the check is traced).
            for a in args:
                if isinstance(a, (bool, int, float, complex)):
                    self._refuse_numbers_for_tensors(args, kwargs)
                    break
            for a in kwargs.values():
                if isinstance(a, (bool, int, float, complex)):
                    self._refuse_numbers_for_tensors(args, kwargs)
                    break
            # The op's overload itself: dynamo puts it in the graph at the cost of one guard.
            if self._mutated_idx is None:
                return self._overload(*args, **kwargs)
            i = self._mutated_idx
            # (A slice, not len(args): no guard on the builtins.)
            y = args[i] if args[i : i + 1] else kwargs[self._params[i]]
            # What eager refuses (TensorMut at conversion) and torch refuses of its own in-place
            # operations; under compile the kernel only ever sees AOTAutograd's functional copy,
            # so the rule is checked here, where dynamo traces it (and guards on it). The other
            # rule, no write into an inference tensor outside inference mode, cannot be checked
            # here (dynamo refuses to trace `is_inference()`): torch's own check applies, after
            # the write, as for its own in-place operations compiled or not (eager refuses before).
            if sys.modules["torch"].is_grad_enabled():
                self._refuse_grad_in_place(args, kwargs)
            self._overload(*args, **kwargs)
            return y
        if _PENDING_TORCH:
            _make_pending_torch_ops()
        route = _route(args, kwargs)
        if route == 0:
            try:
                return self._fn(*args, **kwargs)
            except TypeError:
                # None for a tensor that is not optional: said in the author's terms (asked only
                # once the call failed).
                self._refuse_nones_in(args, kwargs)
                raise
        if route & 16:
            route = self._route_with_items(args, kwargs)
            if route == 0:
                try:
                    return self._fn(*args, **kwargs)
                except TypeError:
                    self._refuse_nones_in(args, kwargs)  # a None item of a list, named
                    raise
        if route & 1:
            return self._jax_call(self._bind(args, kwargs))
        if route & 4:
            return self._torch_call(self._bind(args, kwargs))
        # torch tensors: the custom op where autograd must see the call (a tensor that requires
        # grad, 8, in grad mode: the op's autograd applies the backward, or refuses a kernel
        # without one), else the kernel itself. The eager function alone would return a result
        # cut off from autograd, a gradient silently wrong.
        if route & 8 and _grad_enabled():
            return self._torch_call(self._bind(args, kwargs))
        if _forward_ad._current_level >= 0:
            # Inside a forward-AD dual level (torch.func.jvp, jacfwd, dual tensors): the kernel's
            # jvp, through its autograd.Function, or the refusal of a kernel without one (the eager
            # function would drop the tangent). Not decided by looking for a tangent here: called
            # from a torch.compile'd function, that look can run as a frame dynamo compiles with
            # the tensors faked, where no tangent shows (torch 2.11: the tangent was dropped).
            return self._torch_call(self._bind(args, kwargs))
        try:
            return self._fn(*args, **kwargs)
        except TypeError:
            self._refuse_nones_in(args, kwargs)
            raise
        except BufferError:
            # A torch.func transform's wrapped tensor (vmap's batched tensor) has no memory of
            # its own, so the function refused it at conversion, before its body ran: the op's
            # vmap rule takes it (asked only once the call failed: the eager path pays nothing).
            if not _functorch_wrapped(args, kwargs):
                raise
        return self._torch_call(self._bind(args, kwargs))

    def _check_attrs(self, vals: list[Any]) -> list[Any]:
        """``vals`` (bound) with each str and array attribute checked against its declared type
        (an array as a tuple of Python numbers); a wrong value is refused in the author's terms."""
        jax = sys.modules.get("jax")
        for i in self._checked_idx:
            n = self._params[i]
            if jax is not None and isinstance(vals[i], jax.core.Tracer):
                raise TypeError(
                    f"{self.__name__}: {n} is an XLA attribute, static under jax.jit: pass a Python "
                    f"value (close over it, or jax.jit(..., static_argnames=...)), not a traced value"
                )
            vals[i] = _attr_value(self.__name__, n, self._attrs[n], vals[i])
        return vals

    def _check_compiled_attrs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """Under torch.compile (traced by dynamo: the attributes are constants of the graph), each
        str and array attribute checked as eagerly, so a wrong one is refused in the same terms."""
        vals = self._bind(args, kwargs)
        for i in self._checked_idx:
            n = self._params[i]
            vals[i] = _attr_value(self.__name__, n, self._attrs[n], vals[i], compiled=True)
        return vals

    @staticmethod
    def _route_with_items(args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
        """The call's route (``_route``, the one rule) with the items of list and tuple arguments
        counted instead (a list of jax tracers goes to jax, of torch tensors that require grad to
        autograd); a list nested in one counts for nothing."""
        items: list[Any] = []
        for a in (*args, *kwargs.values()):
            if type(a) is list or type(a) is tuple:
                items.extend(a)
            else:
                items.append(a)
        return _route(items, {}) & ~16

    def _refuse_nones_in(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """``_refuse_nones`` over a call's arguments, if one is None."""
        if any(a is None or (isinstance(a, (list, tuple)) and any(_no_item(e) for e in a)) for a in [*args, *kwargs.values()]):
            try:
                vals = self._bind(tuple(args), dict(kwargs))
            except TypeError:
                return
            self._refuse_nones(vals)

    def _refuse_nones(self, vals: Sequence[Any]) -> None:
        """None for a tensor parameter that is not optional, or for an item of a list: said in
        the author's terms."""
        for i, k in zip(self._tensor_idx, self._kinds, strict=True):
            if k == 0 and i < len(vals) and vals[i] is None:
                self._refuse_none(self._params[i])
            if k == 2 and i < len(vals) and isinstance(vals[i], (list, tuple)):
                self._refuse_none_items(self._params[i], vals[i])

    def _refuse_none_items(self, n: str, items: Sequence[Any]) -> None:
        """A None (or a Python number) among the items of list parameter ``n``: refused naming the
        item (torch's schema and jax's conversion would name neither the kernel nor the argument)."""
        for j, e in enumerate(items):
            if e is None:
                raise TypeError(
                    f"{self.__name__}: argument {n!r}[{j}] is None, but {n!r} is a list of tensors "
                    f"(lists={list(self._lists)}): every item is a tensor; leave the item out of the list"
                )
            if isinstance(e, (bool, int, float, complex)):
                raise TypeError(
                    f"{self.__name__}: argument {n!r}[{j}] is a Python {type(e).__name__} ({e!r}), but {n!r} "
                    f"is a list of tensors (lists={list(self._lists)}): every item is a tensor"
                )

    def _attr_dict(self, inputs: Sequence[Any]) -> dict[str, Any]:
        """The attributes among the op's ``inputs`` by name, each array a tuple (torch's op passes
        a list): what a backward and a jvp read."""
        arrays = self._array_idx
        return {self._params[i]: tuple(inputs[i]) if i in arrays else inputs[i] for i in self._attr_idx}

    def _refuse_numbers_for_tensors(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """A Python number passed for a tensor parameter: the op's schema takes a tensor there,
        since the parameter is not named in ``attrs``; say so, and what to declare (torch would
        say "Expected a value of type 'Tensor' for argument")."""
        for n, a in [*zip(self._params, args), *kwargs.items()]:
            if n in self._index and n not in self._attrs and isinstance(a, (bool, int, float, complex)):
                t = "bool" if isinstance(a, bool) else "int64" if isinstance(a, int) else "float64"
                raise TypeError(
                    f"{self.__name__}: argument {n!r} is a Python {type(a).__name__} ({a!r}), but the "
                    f"kernel declares {n!r} a tensor (every parameter not named in attrs is one): "
                    f"declare it a scalar attribute, attrs {{{n!r}: {t!r}}} (Rust: KernelDef {{ attrs: "
                    f'&[("{n}", "{t}")], .. }}), or pass a tensor'
                )

    @staticmethod
    def _tangent_of(a: Any) -> bool:
        """Whether ``a`` is a torch tensor with a tangent (one that cannot say, a tensor batched
        by torch.func.vmap, counts as one: refused rather than dropped)."""
        if not _ROUTE.get(type(a), 0) & 6:
            return False
        try:
            return _forward_ad.unpack_dual(a).tangent is not None
        except RuntimeError:
            return True

    def _refuse_dual_tensors(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Inside a forward-AD dual level, a tensor with a tangent is refused by a kernel without a
        jvp: the eager function would drop the tangent silently (torch's own custom op does)."""
        for n, a in [*zip(self._params, args), *kwargs.items()]:
            if any(self._tangent_of(e) for e in (a if isinstance(a, (list, tuple)) else (a,))):
                raise RuntimeError(
                    f"{self.__name__}: argument {n!r} is a dual tensor (forward-mode AD), but the kernel "
                    "names no jvp (no forward-mode derivative), so its tangent would be dropped: give it "
                    "one (dlbridge.kernels.kernel(..., jvp=...), KernelDef's jvp), differentiate in reverse "
                    "mode (backward, torch.autograd.grad), or pass the primal "
                    "(torch.autograd.forward_ad.unpack_dual(x).primal)"
                )

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        params = self._params
        if len(args) > len(params):
            raise TypeError(f"{self.__name__}() takes {len(params)} arguments, got {len(args)}")
        vals = list(args)
        for i in range(len(args), len(params)):
            n = params[i]
            if n in kwargs:
                vals.append(kwargs[n])
            elif self._defaults[i] is not _EMPTY:
                vals.append(self._defaults[i])
            else:
                raise TypeError(f"{self.__name__}() missing argument {n!r}")
        for n in kwargs:
            j = self._index.get(n)
            if j is None:
                raise TypeError(f"{self.__name__}() got an unexpected keyword argument {n!r}")
            if j < len(args):
                raise TypeError(f"{self.__name__}() got multiple values for argument {n!r}")
        return vals

    def _run_backward(self, named: dict[str, Any]) -> dict[str, Any]:
        bw = self._backward
        if callable(bw):
            return dict(bw(named))
        bk, bargs, bgrads = bw
        res = bk(*[named[n] for n in bargs])
        if len(bgrads) == 1:
            return {bgrads[0]: res}
        return dict(zip(bgrads, res, strict=True))

    def _run_jvp(self, named: dict[str, Any]) -> Any:
        """The result's tangent from the primals, ``out`` and each ``tangent_<parameter>``; for a
        kernel with several results, a tuple of one tangent per result (residuals included), the
        results read by name too."""
        jv = self._jvp
        if callable(jv):
            got = jv(named)
        else:
            jk, jargs = jv
            got = jk(*[named[n] for n in jargs])
        if not self._results:
            self._check_tangents(("out",), (got,), named)
            return got
        n = len(self._results)
        if n == 1 and not isinstance(got, (tuple, list)):
            got = (got,)
        if not isinstance(got, (tuple, list)) or len(got) != n:
            what = f"{len(got)} tangents" if isinstance(got, (tuple, list)) else f"one {type(got).__name__}"
            raise ValueError(
                f"{self.__name__}: its jvp gave {what}, but the kernel declares {n} results "
                f"({', '.join(self._results)}): the jvp gives one tangent per result, residuals "
                "included (the backward reads them, and second order differentiates through them), "
                "as a tuple in that order"
            )
        self._check_tangents(self._results, got, named)
        return tuple(got)

    def _check_tangents(self, results: Sequence[str], tangents: Sequence[Any], named: Mapping[str, Any]) -> None:
        """Each tangent the jvp gave has its result's shape and dtype (a floating result's), else
        an error naming the kernel and the result: torch would keep a tangent of another dtype,
        jax's own errors name neither, and None is no tangent (a zero would make a second
        derivative silently wrong, the backward reading a residual)."""
        for r, t in zip(results, tangents, strict=True):
            p = named[r]
            of = "the result" if r == "out" else repr(r)
            if t is None:
                raise ValueError(
                    f"{self.__name__}: its jvp gave None for the tangent of {of}: give an array of its "
                    "shape and dtype (zeros where it does not depend on the inputs)"
                )
            shape, dtype = getattr(t, "shape", None), getattr(t, "dtype", None)
            if shape is None or dtype is None or not _inexact(p.dtype):
                continue
            if tuple(shape) != tuple(p.shape) or dtype != p.dtype:
                raise ValueError(
                    f"{self.__name__}: its jvp gave the tangent of {of} with shape {tuple(shape)} and "
                    f"dtype {_dtype_name(dtype)}, but {of} has shape {tuple(p.shape)} and dtype "
                    f"{_dtype_name(p.dtype)}: the jvp gives each result's tangent in its shape and "
                    "dtype, in the declared order"
                )

    def _named_primal_results(self, named: dict[str, Any], outs: Sequence[Any]) -> None:
        """What a jvp reads of the results: each by name, ``out`` the first visible one."""
        for r, o in zip(self._results, outs, strict=True):
            named[r] = o
        named["out"] = outs[self._visible[0]]

    def _no_jvp_message(self) -> str:
        """Why forward-mode AD cannot go through this kernel, and what to add."""
        name = self.__name__
        of = ""
        if self._grad_of or self._jvp_of:
            roles = [f"the backward of {k}" for k in self._grad_of] + [f"the jvp of {k}" for k in self._jvp_of]
            of = (
                f"; {name} is {' and '.join(roles)}, so the derivatives of "
                f"{', '.join([*self._grad_of, *self._jvp_of])} are first order only there (hessian, "
                "jacfwd of a gradient, a jvp of a jvp)"
            )
        return (
            f"{name}: no forward-mode derivative (jvp): the kernel names no jvp, so forward-mode AD "
            f"(torch.func.jvp, jacfwd, hessian, forward_ad dual tensors; jax.jvp, jacfwd, hessian) cannot "
            f"go through it{of}: give {name} a jvp (dlbridge.kernels.kernel(..., jvp=...), KernelDef's jvp), "
            "or differentiate in reverse mode"
        )

    # --- torch ---

    def _sync_torch(self) -> None:
        if self._op is None and "torch" in sys.modules:
            _make_pending_torch_ops()

    def _torch_call(self, vals: list[Any]) -> Any:
        op = self._op
        if op is None:
            raise RuntimeError(
                f"{self.__name__}: its torch op does not exist yet: call dlbridge.kernels.torch_ready() "
                "(or any kernel) once after importing torch, before torch.compile traces it"
            )
        try:
            forward_ad = _forward_ad._current_level >= 0
            if forward_ad and self._jvp is None and (self._mutated_idx is not None or _functorch_level() is None):
                # (Under torch.func, the autograd.Function's jvp refuses it, in the same terms.)
                self._refuse_dual_tensors(vals, {})
            if self._mutated_idx is not None:
                if _grad_enabled():
                    self._refuse_grad_in_place(vals, {})
                op(*vals)
                return vals[self._mutated_idx]
            if forward_ad or _functorch_level() is not None:
                # torch.func.grad/jacrev/vmap: torch's custom-op autograd is an autograd.Function
                # without setup_context, which torch.func refuses; this one has it (and the op's
                # vmap rule underneath). Forward-mode AD (dual tensors, torch.func.jvp, jacfwd):
                # its jvp, which a custom op cannot have.
                if self._func is None:
                    self._func = self._make_func(sys.modules["torch"])
                if self._lists:
                    # Each item of a list an input of its own (an autograd.Function sees no
                    # tensor inside a list).
                    spec, flat = self._flat_lists(vals)
                    return self._func.apply(spec, *flat)
                return self._func.apply(*vals)
            return op(*vals)
        except (RuntimeError, TypeError, AttributeError):
            # A Python number (or None) for a tensor parameter: said in the author's terms, not
            # the schema's (asked only once the call failed).
            self._refuse_numbers_for_tensors(vals, {})
            self._refuse_nones(vals)
            raise

    def _refuse_grad_in_place(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """In grad mode, an in-place kernel refuses every argument that requires grad: autograd
        cannot record its write (an in-place op has no backward; torch's own in-place custom op
        would leave the gradients silently wrong). Traced by dynamo under compile."""
        params = self._params
        i = self._mutated_idx
        assert i is not None
        y = args[i] if args[i : i + 1] else kwargs[params[i]]
        if y.requires_grad and y.is_leaf:
            raise TypeError(
                f"{self.__name__}: argument {params[i]!r}: requires_grad: a leaf tensor that requires "
                "grad cannot be written in place (torch refuses it too); write under torch.no_grad(), or "
                "pass a tensor that does not require grad"
            )
        named = [*zip(params, args), *kwargs.items()]
        for n, a in named:
            if getattr(a, "requires_grad", False):
                raise RuntimeError(
                    f"{self.__name__}: argument {n!r} requires grad, but {self.__name__} writes "
                    f"{params[i]!r} in place, which autograd cannot record (an in-place kernel has no "
                    "backward; its gradient would be silently wrong): call it under torch.no_grad(), or "
                    "pass tensors that do not require grad (.detach())"
                )

    def _make_torch_op(self, torch: Any) -> None:
        fn = self._fn
        if self._array_idx:
            # torch hands the implementation each array attribute as a list: a tuple, as in
            # every other mode.
            raw, arrays = fn, self._array_idx

            def fn(*vals: Any) -> Any:
                return raw(*[tuple(v) if i in arrays else v for i, v in enumerate(vals)])

        letters = iter("abcdefghijklmnopqrstuvwxyz")
        parts = []
        for i, n in enumerate(self._params):
            if n in self._attrs:
                t = _ATTR_SCHEMA[self._attrs[n]]
                d = self._defaults[i]
                text = None if d is _EMPTY else _schema_default(self._attrs[n], d)
                parts.append(f"{t} {n}" if text is None else f"{t} {n}={text}")
            elif n in self._mutates:
                parts.append(f"Tensor({next(letters)}!) {n}")
            elif n in self._optional:
                parts.append(f"Tensor? {n}=None" if self._defaults[i] is None else f"Tensor? {n}")
            elif n in self._lists:
                parts.append(f"Tensor[] {n}")
            else:
                parts.append(f"Tensor {n}")
        functional = self._mutated_idx is None
        rets = "Tensor" if functional else "()"
        if self._results:
            rets = f"({', '.join('Tensor' for _ in self._results)})"
        schema = f"({', '.join(parts)}) -> {rets}"
        ns, opname = self._torch_op_names(torch)
        namespace = getattr(torch.ops, ns)

        if self._results:

            def impl(*vals: Any) -> Any:
                outs = self._all_results(fn(*vals))
                # One result: the op returns it alone (torch refuses a 1-tuple for "-> (Tensor)").
                return outs[0] if len(outs) == 1 else outs
        elif functional:

            def impl(*vals: Any) -> Any:
                return fn(*vals)
        else:

            def impl(*vals: Any) -> Any:
                fn(*vals)
                return None

        native = self._native_torch_op(ns, namespace, opname)
        if native is None:
            op = torch.library.custom_op(f"{ns}::{opname}", impl, mutates_args=self._mutates, schema=schema)
        else:
            op = native
        out = self._out
        if self._results:
            tensor_idx, attr_idx, params = self._tensor_idx, self._attr_idx, self._params

            def fake_several(*vals: Any, **kw: Any) -> Any:
                # torch may pass the scalar arguments by keyword.
                bound = self._bind(vals, kw) if kw or len(vals) < len(params) else vals
                per = [bound[i] for i in tensor_idx]
                made = self._result_types(per, {params[i]: bound[i] for i in attr_idx})
                # On the first tensor argument's device (an optional's or a list's first where the
                # parameters before it are such; none at all: torch's default).
                flat = self._flatten(bound)[0] if self._counted else [bound[tensor_idx[0]]]
                if flat:
                    outs = tuple(flat[0].new_empty(shape, dtype=getattr(torch, dtype)) for shape, dtype in made)
                else:
                    outs = tuple(torch.empty(shape, dtype=getattr(torch, dtype)) for shape, dtype in made)
                return outs[0] if len(outs) == 1 else outs

            fake = fake_several
        elif functional:
            rule = out.rule
            n_params = len(self._params)
            if rule is not None:
                tensor_idx = self._tensor_idx

                def fake(*vals: Any, **kw: Any) -> Any:
                    # torch may pass arguments after a defaulted one (Tensor? bias=None) by keyword.
                    bound = self._bind(vals, kw) if kw or len(vals) < n_params else vals
                    shape, dtype = rule(*[bound[i] for i in tensor_idx])
                    return bound[tensor_idx[0]].new_empty(tuple(shape), dtype=getattr(torch, str(dtype)))
            else:
                like: Any = out.like

                def fake(*vals: Any, **kw: Any) -> Any:
                    bound = self._bind(vals, kw) if kw or len(vals) < n_params else vals
                    x = bound[like]
                    return x.new_empty(x.shape)
        else:

            def fake(*vals: Any) -> Any:
                return None

        # A native op's Meta kernel is the output rule, registered natively.
        if native is None:
            op.register_fake(fake)
        # What registers the op's autograd rule: the custom op itself, or torch.library for a
        # native op.
        autograd_target = op if native is None else _LibraryOp(torch, f"{ns}::{opname}")
        if self._backward is not None:
            self._register_torch_autograd(torch, autograd_target)
        elif functional:
            # torch's default for a custom op without autograd raises at backward too; this one
            # says what to do in dlbridge's terms. (An in-place kernel refuses at the call.)
            def no_backward(ctx: Any, *grads: Any) -> Any:
                raise RuntimeError(self._no_backward_message())

            autograd_target.register_autograd(no_backward)
        elif isinstance(autograd_target, _LibraryOp):
            # A native in-place op without a backward refuses an argument that requires grad in
            # grad mode, called directly too (the kernel's own call refuses before it).
            self._autograd_lib = autograd_target.refuse_grad(lambda args: self._refuse_grad_in_place(args, {}))
        self._register_torch_vmap(torch, op)
        self._op = op
        _torch_seen(torch)
        self._overload = getattr(namespace, opname).default
        self._compiling = torch.compiler.is_compiling
        self._eager_forward_ad = torch.compiler.disable(
            self._call_eagerly,
            reason=(
                f"{self.__name__}: forward-mode AD (torch.func.jvp, jacfwd, hessian, dual tensors) of "
                "a kernel under torch.compile: torch compiles no custom op's jvp (its tangent would "
                "be dropped), so the call runs eagerly through the kernel's jvp, a graph break "
                "(refused with fullgraph=True): compile without fullgraph=True, or apply the "
                "forward-mode transform outside the compiled function"
            ),
        )

    def _call_eagerly(self, *args: Any, **kwargs: Any) -> Any:
        """The kernel's call outside torch.compile (what ``_eager_forward_ad`` wraps)."""
        return self(*args, **kwargs)

    def _torch_op_names(self, torch: Any) -> tuple[str, str]:
        """The torch op's namespace and name, ``torch.ops.<namespace>.<name>``: the author's
        (``name=``, ``namespace=``; refused if the op exists already), or derived (the kernel's
        name in the top-level package of its function's module; a kernel made twice gets a
        second op, ``<name>_2``). The one place that names a kernel's torch op."""
        ns, base = self._namespace, self._op_name
        namespace = getattr(torch.ops, ns)
        opname, copy = base, 1
        while hasattr(namespace, opname):
            if self._named:
                raise ValueError(
                    f"kernel {self.__name__}: the torch op {ns}::{opname} exists already: give this "
                    "kernel another name= or namespace="
                )
            copy += 1
            opname = f"{base}_{copy}"
        return ns, opname

    def _native_torch_op(self, ns: str, namespace: Any, opname: str) -> Any:
        """The kernel's native torch op (CPU kernel: its XLA handler; Meta kernel: its output
        rule), defined under ``opname`` through the registrar add_kernel left for its ffi capsule;
        None for the Python custom op: no registrar (no handler, or a kernel made from Python),
        or this torch cannot host it (why not: ``_native_fallback``)."""
        # A stage bundle (a dict, jax's {"instantiate": ..., "execute": ...}) is no capsule and
        # unhashable: no registrar is kept for it.
        ffi = self._ffi
        register = _NATIVE_OPS.pop(ffi, None) if ffi is not None and not isinstance(ffi, dict) else None
        if register is None:
            return None
        defaults = {
            n: d
            for n, d in zip(self._params, self._defaults, strict=True)
            if (n in self._attrs and d is not _EMPTY) or (n in self._optional and d is None)
        }
        self._native_fallback = register(ns, opname, self._params, defaults)
        return getattr(namespace, opname) if self._native_fallback is None else None

    def _register_torch_autograd(self, torch: Any, op: Any) -> None:
        setup_context, backward = self._autograd_rules(torch)
        op.register_autograd(backward, setup_context=setup_context)

    def _register_torch_vmap(self, torch: Any, op: Any) -> None:
        """``torch.func.vmap``'s rule for the op: one call per batch element (as jax's
        ``vmap_method="sequential"``), the results stacked; an in-place kernel writes each
        element of its batched argument (refused when that argument is not batched)."""
        params, mutated = self._params, self._mutated_idx
        several = bool(self._results)

        def rule(info: Any, in_dims: tuple[Any, ...], *vals: Any) -> Any:
            if mutated is not None and in_dims[mutated] is None:
                batched = [params[i] for i, d in enumerate(in_dims) if d is not None]
                raise RuntimeError(
                    f"{self.__name__}: under torch.func.vmap, {params[mutated]!r} is written in place "
                    f"but is not batched while {', '.join(map(repr, batched))} is: each element would "
                    f"write the same tensor; batch {params[mutated]!r} too"
                )
            outs = []
            def pick(v: Any, d: Any, b: int) -> Any:
                if isinstance(v, (list, tuple)) and v and all(isinstance(t, torch.Tensor) for t in v):
                    # a list of tensors: each item's own dim (an array attribute is a tuple of numbers)
                    ds = d if isinstance(d, (list, tuple)) else [d] * len(v)
                    return [t.contiguous() if e is None else t.select(e, b).contiguous() for t, e in zip(v, ds, strict=True)]
                return v if d is None or not isinstance(v, torch.Tensor) else v.select(d, b)

            for b in range(info.batch_size):
                # (An attribute is never batched: its in_dims entry is None.)
                sl = [pick(v, d, b) for v, d in zip(vals, in_dims, strict=True)]
                if mutated is None:
                    outs.append(op(*[t.contiguous() if isinstance(t, torch.Tensor) else t for t in sl]))
                    continue
                y = sl[mutated]
                args = [t.contiguous() if isinstance(t, torch.Tensor) and i != mutated else t for i, t in enumerate(sl)]
                if not y.is_contiguous():
                    args[mutated] = y.contiguous()
                op(*args)
                if args[mutated] is not y:
                    y.copy_(args[mutated])
            if mutated is None:
                if several and not isinstance(outs[0], torch.Tensor):
                    return tuple(torch.stack(o) for o in zip(*outs, strict=True)), tuple(0 for _ in outs[0])
                return torch.stack(outs), 0
            return None, None

        if hasattr(op, "register_vmap"):
            op.register_vmap(rule)
        else:  # a native op (an OpOverloadPacket): through torch.library
            torch.library.register_vmap(op.default, rule)

    def _make_func(self, torch: Any) -> Any:
        """The kernel as an ``autograd.Function`` in torch.func's style (``setup_context``, a vmap
        rule generated through the op's own): what ``torch.func.grad``, ``jacrev`` and ``vmap``
        of a gradient call. Its backward is the kernel's, or the refusal of a kernel with none."""
        overload = self._overload
        if self._backward is not None:
            # With a jvp, a residual stays differentiable here: its tangent (the jvp's) reaches
            # the backward, which reads it, so forward over reverse (hessian) sees it.
            setup_context, backward = self._autograd_rules(torch, residual_tangents=self._jvp is not None)
        else:

            def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
                pass

            def backward(ctx: Any, *grads: Any) -> Any:
                raise RuntimeError(self._no_backward_message())

        params, tensor_idx = self._params, self._tensor_idx
        setup_backward = setup_context
        if self._jvp is not None:
            several = bool(self._results)
            n_in = len(tensor_idx)
            lists = bool(self._lists)

            def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
                setup_backward(ctx, inputs, output)
                outs = self._all_results(output) if several else (output,)
                if lists:
                    # A list's items saved flat (with the counts), as the backward saves them.
                    flat, ctx.dlbridge_jvp_counts = self._flatten(_full_inputs(self, inputs))
                    ctx.dlbridge_jvp_n = len(flat)
                    ctx.save_for_forward(*flat, *outs)
                else:
                    ctx.save_for_forward(*[inputs[i] for i in tensor_idx], *outs)
                ctx.dlbridge_jvp_attrs = self._attr_dict(inputs)

            def jvp(ctx: Any, *tangents: Any) -> Any:
                saved = ctx.saved_tensors
                n = ctx.dlbridge_jvp_n if lists else n_in
                ins = saved[:n]
                per = self._unflatten(ins, ctx.dlbridge_jvp_counts) if lists else list(ins)
                contiguous = lambda t: t if t is None else t.contiguous()  # noqa: E731
                named = {
                    params[i]: [contiguous(e) for e in t] if isinstance(t, list) else contiguous(t)
                    for i, t in zip(tensor_idx, per, strict=True)
                }
                outs = [o.contiguous() for o in saved[n:]]
                if several:
                    self._named_primal_results(named, outs)
                else:
                    named["out"] = outs[0]
                for i, t in zip(tensor_idx, per, strict=True):
                    d = tangents[i]
                    if t is None:  # an absent optional tensor: no tangent either
                        named[params[i]] = named[f"tangent_{params[i]}"] = None
                        continue
                    if isinstance(t, list):  # a list: one tangent per item
                        ds = [None] * len(t) if d is None else list(d)
                        named[f"tangent_{params[i]}"] = [
                            torch.zeros_like(e) if de is None else de.contiguous() for e, de in zip(t, ds, strict=True)
                        ]
                        continue
                    named[f"tangent_{params[i]}"] = torch.zeros_like(t) if d is None else d.contiguous()
                named.update(ctx.dlbridge_jvp_attrs)
                return self._run_jvp(named)
        else:

            def jvp(ctx: Any, *tangents: Any) -> Any:
                raise RuntimeError(self._no_jvp_message())

        if self._lists:
            return self._flat_func(torch, setup_context, backward, jvp)
        return type(
            f"{self._op_name}_function",
            (torch.autograd.Function,),
            {
                "generate_vmap_rule": True,
                "forward": staticmethod(lambda *vals: overload(*vals)),
                "setup_context": staticmethod(setup_context),
                "backward": staticmethod(backward),
                "jvp": staticmethod(jvp),
            },
        )

    def _flat_lists(self, vals: Sequence[Any]) -> tuple[tuple[int, ...], list[Any]]:
        """``vals`` (one per parameter) with each list's items in its place, flat, and each
        list's length: what ``_flat_func``'s ``autograd.Function`` takes, so torch.func sees
        every item as an input of its own."""
        spec: list[int] = []
        flat: list[Any] = []
        for i, v in enumerate(vals):
            if i in self._list_idx:
                if not isinstance(v, (list, tuple)):
                    self._flatten(vals)  # refused there, in the author's terms
                spec.append(len(v))
                flat.extend(v)
            else:
                flat.append(v)
        return tuple(spec), flat

    def _unflat_lists(self, spec: Sequence[int], flat: Sequence[Any]) -> list[Any]:
        """``_flat_lists``'s inverse: one value per parameter, each list a list."""
        vals: list[Any] = []
        counts = iter(spec)
        at = 0
        for i in range(len(self._params)):
            if i in self._list_idx:
                c = next(counts)
                vals.append(list(flat[at : at + c]))
                at += c
            else:
                vals.append(flat[at])
                at += 1
        return vals

    def _flat_func(self, torch: Any, setup_context: Any, backward: Any, jvp: Any) -> Any:
        """``_make_func``'s ``autograd.Function`` for a kernel with list parameters: it takes
        ``(spec, *flat)`` (``_flat_lists``), so each item of a list is an input torch.func
        differentiates and batches; the rules run on the values one per parameter, and each
        list's gradients (tangents) go back to its items."""
        overload = self._overload
        list_idx = self._list_idx

        def forward(spec: tuple[int, ...], *flat: Any) -> Any:
            return overload(*self._unflat_lists(spec, flat))

        def flat_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            ctx.dlbridge_spec = inputs[0]
            setup_context(ctx, tuple(self._unflat_lists(inputs[0], inputs[1:])), output)

        def flat_backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
            per = backward(ctx, *grads)
            out: list[Any] = [None]
            counts = iter(ctx.dlbridge_spec)
            for i in range(len(self._params)):
                g = per[i] if i < len(per) else None
                if i in list_idx:
                    c = next(counts)
                    out.extend([None] * c if g is None else g)
                else:
                    out.append(g)
            return tuple(out)

        def flat_jvp(ctx: Any, *tangents: Any) -> Any:
            return jvp(ctx, *self._unflat_lists(ctx.dlbridge_spec, tangents[1:]))

        return type(
            f"{self._op_name}_function",
            (torch.autograd.Function,),
            {
                "generate_vmap_rule": True,
                "forward": staticmethod(forward),
                "setup_context": staticmethod(flat_setup_context),
                "backward": staticmethod(flat_backward),
                "jvp": staticmethod(flat_jvp),
            },
        )

    def _autograd_rules(self, torch: Any, residual_tangents: bool = False) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """The ``setup_context`` and ``backward`` of a kernel that names a backward (residuals
        marked non-differentiable unless ``residual_tangents``: forward mode gives them tangents)."""
        params, tensor_idx = self._params, self._tensor_idx
        if self._results:
            return self._autograd_rules_several(torch, residual_tangents)

        if self._counted:
            return self._autograd_rules_counted(torch)

        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            ctx.save_for_backward(*[inputs[i] for i in tensor_idx], output)
            ctx.dlbridge_attrs = self._attr_dict(inputs)

        def backward(ctx: Any, grad: Any) -> tuple[Any, ...]:
            saved = ctx.saved_tensors
            named = {params[i]: t.contiguous() for i, t in zip(tensor_idx, saved[:-1], strict=True)}
            named["out"] = saved[-1].contiguous()
            named["grad"] = grad.contiguous()
            named.update(ctx.dlbridge_attrs)
            grads = self._run_backward(named)
            result = tuple(grads.get(n) if i in tensor_idx else None for i, n in enumerate(params))
            if torch.is_grad_enabled():
                # create_graph=True: each gradient must carry its graph for a double backward.
                result = self._first_order_only(torch, result, (grad, *saved))
            return _fit_inputs(ctx, result)

        return setup_context, backward

    def _autograd_rules_counted(self, torch: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """``setup_context`` and ``backward`` of a kernel with optional or list parameters: the
        tensors are saved flat (with their counts), the backward reads each parameter as the
        kernel does (None, or a list) and gives a gradient per list item and None for an absent
        optional."""
        params, tensor_idx, attr_idx, kinds = self._params, self._tensor_idx, self._attr_idx, self._kinds

        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            flat, counts = self._flatten(_full_inputs(self, inputs))
            ctx.save_for_backward(*flat, output)
            ctx.dlbridge_counts = counts
            ctx.dlbridge_attrs = {params[i]: inputs[i] for i in attr_idx}

        def backward(ctx: Any, grad: Any) -> tuple[Any, ...]:
            saved = ctx.saved_tensors
            per = self._unflatten([t.contiguous() for t in saved[:-1]], ctx.dlbridge_counts)
            named = {params[i]: v for i, v in zip(tensor_idx, per, strict=True)}
            named["out"] = saved[-1].contiguous()
            named["grad"] = grad.contiguous()
            named.update(ctx.dlbridge_attrs)
            grads = self._run_backward(named)
            return _fit_inputs(ctx, self._counted_grads(torch, grads, per, (grad, *saved)))

        return setup_context, backward

    def _counted_grads(self, torch: Any, grads: Mapping[str, Any], per: Sequence[Any], flat_in: tuple[Any, ...]) -> tuple[Any, ...]:
        """A torch backward's gradients, one per parameter, of a kernel with optional or list
        parameters: from ``grads`` (the kernel's backward's, by name) and ``per`` (each tensor
        parameter's argument: None for an absent optional, a list for a list), a list of
        gradients for a list parameter and None for an absent optional. Under create_graph=True a
        gradient without a graph is refused (``_first_order_only``) against ``flat_in``."""
        params, tensor_idx, kinds = self._params, self._tensor_idx, self._kinds
        result: list[Any] = [None] * len(params)
        for i, k, v in zip(tensor_idx, kinds, per, strict=True):
            g = grads.get(params[i])
            if k == 2:
                gs = [None] * len(v) if g is None else list(g)
                if len(gs) != len(v):
                    raise ValueError(
                        f"{self.__name__}: the backward gave {len(gs)} gradients for {params[i]!r}, a list of {len(v)} tensors"
                    )
                result[i] = gs
            else:
                result[i] = None if v is None else g
        if torch.is_grad_enabled():
            # create_graph=True: a gradient without a graph is refused at the second backward.
            out: list[Any] = []
            for i, r in enumerate(result):
                if isinstance(r, list):
                    items = [f"{params[i]}[{j}]" for j in range(len(r))]
                    out.append(list(self._first_order_only(torch, tuple(r), flat_in, items)))
                else:
                    out.append(r)
            single = [r if not isinstance(r, list) else None for r in out]
            single = list(self._first_order_only(torch, tuple(single), flat_in))
            result = [o if isinstance(o, list) else single[j] for j, o in enumerate(out)]
        return tuple(result)

    def _autograd_rules_several(self, torch: Any, residual_tangents: bool) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """``setup_context`` and ``backward`` of a kernel with several results: every result (the
        residuals too) is saved; residuals are non-differentiable outputs, unless
        ``residual_tangents`` (their cotangent is then zero, as the caller never sees them)."""
        params, tensor_idx = self._params, self._tensor_idx
        n_in = len(tensor_idx)
        n_out = len(self._results)
        counted = self._counted
        residual_idx = [] if residual_tangents else [i for i in range(n_out) if i not in self._visible]

        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            output = self._all_results(output)  # (one result: the op returns it alone)
            if counted:
                # Optional and list parameters: the tensors saved flat, with their counts.
                flat, ctx.dlbridge_counts = self._flatten(_full_inputs(self, inputs))
                ctx.save_for_backward(*flat, *output)
            else:
                ctx.save_for_backward(*[inputs[i] for i in tensor_idx], *output)
            ctx.dlbridge_attrs = self._attr_dict(inputs)
            if residual_idx:
                ctx.mark_non_differentiable(*[output[i] for i in residual_idx])

        def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
            saved = ctx.saved_tensors
            ins, outs = saved[: len(saved) - n_out], [o.contiguous() for o in saved[len(saved) - n_out :]]
            if counted:
                per = self._unflatten([t.contiguous() for t in ins], ctx.dlbridge_counts)
                named = {params[i]: v for i, v in zip(tensor_idx, per, strict=True)}
            else:
                named = {params[i]: t.contiguous() for i, t in zip(tensor_idx, ins[:n_in], strict=True)}
            gs = [torch.zeros_like(o) if g is None else g.contiguous() for g, o in zip(grads, outs, strict=True)]
            self._named_results(named, outs, gs)
            named.update(ctx.dlbridge_attrs)
            got = self._run_backward(named)
            flat_in = (*[g for g in grads if g is not None], *saved)
            if counted:
                return _fit_inputs(ctx, self._counted_grads(torch, got, per, flat_in))
            result = tuple(got.get(n) if i in tensor_idx else None for i, n in enumerate(params))
            if torch.is_grad_enabled():
                result = self._first_order_only(torch, result, flat_in)
            return _fit_inputs(ctx, result)

        return setup_context, backward

    def _first_order_only(
        self, torch: Any, result: tuple[Any, ...], inputs: tuple[Any, ...], names: Sequence[str] | None = None
    ) -> tuple[Any, ...]:
        """Under create_graph=True, a gradient the backward returned cut off from autograd (a plain
        function's result: it does not require grad while the backward's inputs do) becomes the
        output of a node whose inputs are the backward's and whose backward raises, instead of
        counting as a constant (a double backward silently wrong). Gradients made of
        differentiable operations (torch ops, kernels with a backward) keep their graph.
        (torch's ``once_differentiable`` hangs its error on detached stand-ins, which a double
        backward with ``allow_unused=True``, as gradgradcheck's, never reaches: zeros.)"""
        live = [t for t in inputs if t.requires_grad]
        if not live:
            return result
        out = list(result)
        for j, g in enumerate(result):
            if isinstance(g, torch.Tensor) and not g.requires_grad:
                message = (
                    f"{self.__name__}: its gradient is first order only: its backward returned the "
                    f"gradient of {(names or self._params)[j]!r} without a graph, so it cannot be differentiated "
                    "again (double backward, create_graph=True, gradgradcheck); write the backward with "
                    "differentiable operations (torch ops, or kernels that name a backward of their own)"
                )
                out[j] = _first_order_function(torch).apply(message, g, *live)
        return tuple(out)

    def _no_backward_message(self) -> str:
        """Why torch cannot differentiate through this kernel, and what to do."""
        name = self.__name__
        if self._grad_of:
            of = ", ".join(self._grad_of)
            return (
                f"{name}: no autograd formula: {name} is the backward of {of} and names no backward of "
                f"its own, so the gradient of {of} is first order only: double backward "
                f"(create_graph=True, gradgradcheck) is refused; give {name} a backward "
                "(dlbridge.kernels.kernel(..., backward=...), add_kernel's backward) to differentiate twice"
            )
        if self._jvp_of:
            # Called by a kernel's jvp, not by the caller: a gradient of a tangent.
            of = ", ".join(self._jvp_of)
            return (
                f"{name}: no autograd formula: {name} is the jvp of {of} and names no backward, so a "
                f"tangent of {of} cannot be differentiated in reverse mode (a backward through a "
                "forward-mode result, torch.func.grad of torch.func.jvp, an input that requires grad "
                f"with a dual tensor): give {name} a backward (dlbridge.kernels.kernel(..., "
                "backward=...), add_kernel's backward), or detach what requires grad before forward mode"
            )
        return (
            f"{name}: no autograd formula: the kernel names no backward, so torch cannot "
            "differentiate through it (an input required grad); name one (dlbridge.kernels.kernel(..., "
            "backward=...), add_kernel's backward), or call it under torch.no_grad() or on tensors that "
            "do not require grad (.detach())"
        )

    # --- jax ---

    def _jax_call(self, vals: list[Any]) -> Any:
        jax = sys.modules["jax"]
        if self._ffi is None:
            raise TypeError(
                f"{self.__name__}: called with jax tracers (inside jax.jit, vmap or grad), but the "
                "kernel has no XLA FFI handler (kernel(..., ffi=capsule))"
            )
        if self._target not in _JAX_TARGETS:
            # Made while jax was being imported, or its registration failed then: now (it raises).
            self._register_jax_target(jax)
        import numpy as np

        named = []
        for i in self._attr_idx:
            n = self._params[i]
            if isinstance(vals[i], jax.core.Tracer):
                raise TypeError(
                    f"{self.__name__}: {n} is an XLA attribute, static under jax.jit: pass a Python "
                    f"value (close over it, or jax.jit(..., static_argnames=...)), not a traced value"
                )
            t = self._attrs[n]
            # A str or an array (a tuple, checked at the call) as it is; a scalar as its type.
            named.append((n, vals[i] if t not in _SCALAR_ATTRS else np.dtype(t).type(vals[i])))
        if self._counted:
            # Flat operands (a list's items, no absent optional) and a count attribute for each
            # optional or list parameter, which the handler declares (Operand::Optional, List).
            tensors, counts = self._flatten(vals)
            named += [(n, np.int64(c)) for n, c in counts]
        else:
            tensors = [vals[i] for i in self._tensor_idx]
            if any(t is None for t in tensors):
                self._refuse_nones(vals)
        attrs = tuple(named)
        for t in tensors:
            if isinstance(t, (bool, int, float, complex)):
                self._refuse_numbers_for_tensors(vals, {})
        if self._backward is None and self._jvp is None:
            return self._jax_ffi(jax, attrs, tensors)
        if self._jax_ad is None:
            self._jax_ad = self._make_jax_ad(jax)
        return self._jax_ad(attrs, *tensors)

    def _register_jax_target(self, jax: Any) -> None:
        if self._target not in _JAX_TARGETS:
            fn = self._ffi if isinstance(self._ffi, dict) else _FFI_BUNDLES.get(self._ffi, self._ffi)
            jax.ffi.register_ffi_target(self._target, fn, platform="cpu")
            _JAX_TARGETS[self._target] = self._ffi

    def _ffi_attrs(self, attrs: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
        """The attributes as ``ffi_call`` passes them to XLA: an array as a numpy array of its
        declared element type (an XLA array attribute), a str and a scalar as they are."""
        if not self._checked_idx:
            return dict(attrs)
        import numpy as np

        out = {}
        for n, v in attrs:
            t = self._attrs.get(n, "")  # (a count attribute, `<name>.count`, is no parameter's)
            # (XLA has no bool array attribute: bytes 0 and 1, which the handler reads as &[bool].)
            out[n] = np.asarray(v, dtype="uint8" if t == "bool[]" else t[:-2]) if t.endswith("[]") else v
        return out

    def _jax_ffi(self, jax: Any, attrs: tuple[tuple[str, Any], ...], tensors: Sequence[Any]) -> Any:
        jnp = jax.numpy
        tensors = [jnp.asarray(t) for t in tensors]
        out = self._out
        if self._results:
            made = self._result_types(self._unflatten(tensors, attrs) if self._counted else tensors, dict(attrs))
            types = [jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for shape, dtype in made]
            call = jax.ffi.ffi_call(self._target, types, vmap_method=self._vmap_method)
            return tuple(call(*tensors, **self._ffi_attrs(attrs)))
        per = self._unflatten(tensors, attrs)
        if out.rule is not None:
            shape, dtype = out.rule(*per)
            result = jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(str(dtype)))
        else:
            like = per[self._tensor_idx.index(out.like)]
            result = jax.ShapeDtypeStruct(like.shape, like.dtype)
        aliases = None
        if self._mutated_idx is not None:
            at = self._tensor_idx.index(self._mutated_idx)
            # Its flat operand: after the items of the parameters before it.
            flat_at = sum(1 if k == 0 else len(v) if k == 2 else int(v is not None) for k, v in zip(self._kinds[:at], per[:at]))
            aliases = {flat_at: 0}
        call = jax.ffi.ffi_call(
            self._target, result, vmap_method=self._vmap_method, input_output_aliases=aliases
        )
        return call(*tensors, **self._ffi_attrs(attrs))

    def _make_jax_ad(self, jax: Any) -> Any:
        """The kernel as a ``jax.custom_jvp`` whose tangent is a linear call (``_linear_call``):
        forward mode evaluates the kernel's jvp, reverse mode transposes the call into the kernel's
        backward. So ``jax.jvp``/``jacfwd`` need a jvp, ``jax.grad``/``vjp``/``jacrev`` a
        backward, and ``hessian`` (forward over reverse) a backward that has a jvp of its own;
        each missing one is refused in these terms when it is needed, never a silent zero."""
        names = [self._params[i] for i in self._tensor_idx]
        several = bool(self._results)
        jnp = jax.numpy

        @functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
        def f(attrs: tuple[tuple[str, Any], ...], *tensors: Any) -> Any:
            return self._jax_ffi(jax, attrs, tensors)

        def f_jvp(attrs: tuple[tuple[str, Any], ...], primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> Any:
            # Through f itself: primals that carry an outer transform's tangent (hessian's
            # jacfwd around jacrev) differentiate it again.
            out = f(attrs, *primals)
            outs = tuple(out) if several else (out,)
            # The flat operands' count (a list's items, no absent optional: _flatten).
            n = len(primals)

            def tangent(res: tuple[Any, ...], lin: tuple[Any, ...]) -> tuple[Any, ...]:
                if self._jvp is None:
                    raise TypeError(self._no_jvp_message())
                named = dict(zip(names, self._unflatten(res[:n], attrs), strict=True))
                named.update(attrs)
                if several:
                    self._named_primal_results(named, res[n:])
                else:
                    named["out"] = res[n]
                for p, t in zip(names, self._unflatten(lin, attrs), strict=True):
                    named[f"tangent_{p}"] = t
                if several:
                    return tuple(jnp.asarray(t) for t in self._run_jvp(named))
                return (jnp.asarray(self._run_jvp(named)),)

            def cotangent(res: tuple[Any, ...], cts: tuple[Any, ...]) -> tuple[Any, ...]:
                if self._backward is None:
                    raise TypeError(self._no_jax_backward_message())
                tensors, outs = res[:n], res[n:]
                per = self._unflatten(tensors, attrs)
                named = dict(zip(names, per, strict=True))
                named.update(attrs)
                if several:
                    self._named_results(named, outs, cts)
                else:
                    named["out"] = outs[0]
                    named["grad"] = cts[0]
                grads = self._run_backward(named)
                if self._counted:
                    given = [grads.get(p) for p in names]
                    flat = self._flat_grads(given, per, jnp.zeros_like)
                    return tuple(jnp.asarray(g) for g in flat)
                return tuple(
                    jnp.asarray(grads[p]) if p in grads else jnp.zeros_like(t)
                    for p, t in zip(names, tensors, strict=True)
                )

            jv = self._jvp
            tangent.callee = jv[0] if isinstance(jv, tuple) else None  # type: ignore[attr-defined]
            bw = self._backward
            cotangent.callee = bw[0] if isinstance(bw, tuple) else None  # type: ignore[attr-defined]
            tans = _linear_call(jax, tangent, cotangent, (*primals, *outs), tuple(tangents), outs, primals)
            return out, (tuple(tans) if several else tans[0])

        f.defjvp(f_jvp)
        return f

    def _no_jax_backward_message(self) -> str:
        name = self.__name__
        of = ""
        if self._grad_of or self._jvp_of:
            roles = [f"the backward of {k}" for k in self._grad_of] + [f"the jvp of {k}" for k in self._jvp_of]
            of = (
                f"; {name} is {' and '.join(roles)}, so the derivatives of "
                f"{', '.join([*self._grad_of, *self._jvp_of])} are first order only in reverse mode"
            )
        return (
            f"{name}: no backward: the kernel names a jvp only, so reverse-mode AD (jax.grad, vjp, "
            f"jacrev, a gradient of a gradient) cannot go through it{of}: give {name} a backward "
            "(dlbridge.kernels.kernel(..., backward=...), add_kernel's backward)"
        )


def _inexact(dtype: Any) -> bool:
    """Whether ``dtype`` (numpy's, jax's or torch's) is a floating or complex one (ml_dtypes'
    bfloat16 is kind ``V``), whose tangent has the same dtype."""
    kind = getattr(dtype, "kind", None)
    if kind is not None:
        return kind in "fcV"
    return bool(getattr(dtype, "is_floating_point", False) or getattr(dtype, "is_complex", False))


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _picker(visible: tuple[int, ...]) -> Callable[[Sequence[Any]], Any]:
    """What a kernel with several results returns of the raw results: the visible one, or a tuple
    of the visible ones (a plain function: dynamo inlines it)."""
    if len(visible) == 1:
        i = visible[0]

        def pick(outs: Sequence[Any]) -> Any:
            return outs[i]
    else:

        def pick(outs: Sequence[Any]) -> Any:
            return tuple(outs[j] for j in visible)

    return pick


class _SeveralResults(Kernel):
    """A kernel with several results (``results=``): every mode computes them all (the raw op
    returns them all); the caller gets the visible ones, one tensor or a tuple."""

    _pick: Callable[[Sequence[Any]], Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiling():
            # As Kernel.__call__ under dynamo, reading as little (each read is a guard checked at
            # every compiled call): the op's overload, then the visible results.
            if _forward_ad._current_level >= 0:
                # Forward-mode AD: eagerly, through the kernel's jvp (see Kernel.__call__).
                return self._eager_forward_ad(*args, **kwargs)
            for a in args:
                if isinstance(a, (bool, int, float, complex)):
                    self._refuse_numbers_for_tensors(args, kwargs)
                    break
            for a in kwargs.values():
                if isinstance(a, (bool, int, float, complex)):
                    self._refuse_numbers_for_tensors(args, kwargs)
                    break
            return self._pick(self._all_results(self._overload(*args, **kwargs)))
        return self._pick(self._all_results(Kernel.__call__(self, *args, **kwargs)))


class _CheckedAttrs(Kernel):
    """A kernel with str or array attributes: each checked against its declared type before the
    call goes on (an array as a tuple of Python numbers), in every mode; under torch.compile the
    check is traced (the values are constants of the graph)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiling():
            return Kernel.__call__(self, *self._check_compiled_attrs(args, kwargs))
        return Kernel.__call__(self, *self._check_attrs(self._bind(args, kwargs)))


class _CheckedSeveralResults(_SeveralResults):
    """``_CheckedAttrs`` for a kernel with several results."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiling():
            return _SeveralResults.__call__(self, *self._check_compiled_attrs(args, kwargs))
        return _SeveralResults.__call__(self, *self._check_attrs(self._bind(args, kwargs)))


_CHECKED_CLASSES: dict[type, type] = {Kernel: _CheckedAttrs, _SeveralResults: _CheckedSeveralResults}


def _checked_class(cls: type) -> type:
    """The class that checks str and array attributes before ``cls``'s own call: one of the two
    above, or, for a subclass of ``Kernel`` of the caller's, a subclass of it made once."""
    checked = _CHECKED_CLASSES.get(cls)
    if checked is None:
        call = cls.__call__

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self._compiling():
                return call(self, *self._check_compiled_attrs(args, kwargs))
            return call(self, *self._check_attrs(self._bind(args, kwargs)))

        checked = type(cls.__name__, (cls,), {"__call__": __call__, "__doc__": cls.__doc__})
        checked.__module__ = cls.__module__
        checked.__qualname__ = cls.__qualname__
        _CHECKED_CLASSES[cls] = checked
    return checked


def _full_inputs(kernel: Any, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """A torch op's ``inputs`` one per parameter: a call that leaves out trailing defaulted
    arguments (``Tensor? bias=None``) has fewer (see ``_fit_inputs``); theirs are the defaults."""
    n = len(inputs)
    return inputs if n >= len(kernel._params) else (*inputs, *kernel._defaults[n:])


def _no_item(e: Any) -> bool:
    """Whether ``e``, an item of a list argument, is no tensor a kernel could take: None or a
    Python number (asked once a call failed)."""
    return e is None or isinstance(e, (bool, int, float, complex))


def _fit_inputs(ctx: Any, result: tuple[Any, ...]) -> tuple[Any, ...]:
    """A torch backward's gradients, one per input the op was called with: before torch 2.12 or
    so, a call that leaves out trailing defaulted arguments (``Tensor? bias=None``) has fewer
    inputs than parameters (``ctx.needs_input_grad`` says how many), and torch.library refuses
    a gradient for each parameter ("Expected the return from backward to be of the same
    structure as the inputs"). What is cut is a left-out argument's: None. Not for
    ``_flat_func``'s ``autograd.Function`` (``ctx.dlbridge_spec``): its inputs are the lists' items,
    flat, which may be fewer than the parameters (two empty lists), and its backward maps the
    gradients, one per parameter, onto them itself."""
    if hasattr(ctx, "dlbridge_spec"):
        return result
    n = len(ctx.needs_input_grad)
    return result[:n] if n < len(result) else result


def _functorch_wrapped(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether an argument is a torch.func transform's wrapped tensor (batched, grad-tracking),
    or the legacy vmap's batched tensor (``torch._vmap_internals``, which ``gradcheck``'s
    ``check_batched_grad`` uses): the op takes both, the legacy one through torch's per-example
    fallback."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    functorch = torch._C._functorch
    wrapped = functorch.is_functorch_wrapped_tensor
    legacy = getattr(functorch, "is_legacy_batchedtensor", None)
    return any(
        isinstance(e, torch.Tensor) and (wrapped(e) or (legacy is not None and legacy(e)))
        for a in [*args, *kwargs.values()]
        for e in (a if isinstance(a, (list, tuple)) else (a,))  # a list's items too
    )


class _LibraryOp:
    """A natively defined op's ``register_autograd``, as a custom op has it (autograd has no
    stable C API: its formula stays Python, registered on the native op)."""

    __slots__ = ("qualname", "torch")

    def __init__(self, torch: Any, qualname: str) -> None:
        self.torch = torch
        self.qualname = qualname

    def register_autograd(self, backward: Any, /, *, setup_context: Any = None) -> None:
        self.torch.library.register_autograd(self.qualname, backward, setup_context=setup_context)

    def refuse_grad(self, refuse: Any) -> Any:
        """An autograd kernel for an op that writes in place and has no backward (register_autograd
        takes no mutating op): ``refuse(args)`` in grad mode, then the op below autograd. torch's
        fallback ran such an op and lost the gradient silently: eagerly, the CPU kernel refuses
        what it sees, but under torch.compile (AOTAutograd traces here) and torch.func (whose
        transforms unwrap the tensors) only this kernel sees that an argument requires grad.
        Returns the library, which must be kept alive (dropping it removes the kernel)."""
        torch = self.torch
        ns, name = self.qualname.split("::")
        op = getattr(getattr(torch.ops, ns), name).default
        below = torch._C._after_autograd_keyset

        def autograd(keyset: Any, *args: Any) -> Any:
            if torch.is_grad_enabled():
                refuse(args)
            return op.redispatch(keyset & below, *args)

        lib = torch.library.Library(ns, "IMPL")
        lib.impl(name, autograd, "Autograd", with_keyset=True)
        return lib


_FIRST_ORDER: Any = None


def _first_order_function(torch: Any) -> Any:
    """An autograd Function returning a given tensor as an output of the given inputs, whose
    backward raises the message it was given (made once torch is there)."""
    global _FIRST_ORDER
    if _FIRST_ORDER is None:

        class FirstOrderOnly(torch.autograd.Function):
            # torch.func's style (setup_context, a generated vmap rule), so a gradient made
            # under torch.func.jacrev or vmap(grad) is tied the same way.
            generate_vmap_rule = True

            @staticmethod
            def forward(message: str, g: Any, *inputs: Any) -> Any:
                return g.view_as(g)

            @staticmethod
            def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
                ctx.message = inputs[0]
                ctx.save_for_forward(inputs[1])

            @staticmethod
            def backward(ctx: Any, *grads: Any) -> Any:
                raise RuntimeError(ctx.message)

            @staticmethod
            def jvp(ctx: Any, message: Any, g_t: Any, *inputs_t: Any) -> Any:
                # Forward mode over the backward (hessian): the gradient's own tangent, which the
                # kernels that made it computed (their jvp); none while an input has one: refused.
                if g_t is None:
                    if any(t is not None for t in inputs_t):
                        raise RuntimeError(ctx.message)
                    return torch.zeros_like(ctx.saved_tensors[0])
                return g_t

        _FIRST_ORDER = FirstOrderOnly
    return _FIRST_ORDER


_LINEAR: Any = None


def _aval(jax: Any, x: Any) -> Any:
    return jax.core.ShapedArray(tuple(x.shape), x.dtype)


def _linear_call(
    jax: Any,
    fn: Callable[..., Any],
    fn_t: Callable[..., Any],
    res: tuple[Any, ...],
    lin: tuple[Any, ...],
    like_out: Sequence[Any],
    like_lin: Sequence[Any],
) -> Any:
    """``fn(res, lin)``, a function linear in ``lin`` (the kernel's jvp), as a jax primitive
    whose transpose is ``fn_t(res, cts)`` (the kernel's backward) and the other way round, so one
    tangent rule serves forward and reverse mode. Its own jvp is linear in ``lin``; the part in
    ``res`` (second order) differentiates ``fn`` as jax does any function, which asks the kernel
    it calls for that kernel's jvp (refused, first order only, where it has none). Batched by
    mapping ``fn`` and ``fn_t`` (the kernels' own vmap rules underneath). (jax's
    ``linear_call`` has no batching rule, and a ``custom_vjp`` in a tangent cannot be transposed.)"""
    return _linear_primitive(jax).bind(
        *res,
        *lin,
        fn=fn,
        fn_t=fn_t,
        n_res=len(res),
        out_avals=tuple(_aval(jax, o) for o in like_out),
        lin_avals=tuple(_aval(jax, t) for t in like_lin),
    )


def _linear_primitive(jax: Any) -> Any:
    global _LINEAR
    if _LINEAR is not None:
        return _LINEAR
    from jax.extend.core import Primitive
    from jax.interpreters import ad, batching, mlir

    prim = Primitive("dlbridge_linear_call")
    prim.multiple_results = True

    def impl(*args: Any, fn: Any, fn_t: Any, n_res: int, out_avals: Any, lin_avals: Any) -> Any:
        return tuple(fn(tuple(args[:n_res]), tuple(args[n_res:])))

    def abstract(*args: Any, out_avals: Any, **params: Any) -> Any:
        return list(out_avals)

    def jvp(primals: Sequence[Any], tangents: Sequence[Any], *, fn: Any, fn_t: Any, n_res: int, out_avals: Any, lin_avals: Any) -> Any:
        res, lin = tuple(primals[:n_res]), tuple(primals[n_res:])
        dres, dlin = tangents[:n_res], tangents[n_res:]
        params = dict(fn=fn, fn_t=fn_t, n_res=n_res, out_avals=out_avals, lin_avals=lin_avals)
        out = prim.bind(*primals, **params)
        tan = list(prim.bind(*res, *[ad.instantiate_zeros(t) for t in dlin], **params))
        if any(type(t) is not ad.Zero for t in dres):
            # Second order: fn's derivative in its residuals, through the kernel it calls.
            callee = getattr(fn, "callee", None)
            if isinstance(callee, Kernel) and callee._jvp is None:
                raise TypeError(callee._no_jvp_message())
            dres = tuple(ad.instantiate_zeros(t) for t in dres)
            _, more = jax.jvp(lambda *r: tuple(fn(tuple(r), lin)), res, dres)
            tan = [a + b for a, b in zip(tan, more, strict=True)]
        return out, tan

    def transpose(cts: Sequence[Any], *args: Any, fn: Any, fn_t: Any, n_res: int, out_avals: Any, lin_avals: Any) -> Any:
        res = args[:n_res]
        cts = [ad.instantiate_zeros(c) for c in cts]
        got = prim.bind(*res, *cts, fn=fn_t, fn_t=fn, n_res=n_res, out_avals=lin_avals, lin_avals=out_avals)
        return [None] * n_res + list(got)

    def batch(args: Sequence[Any], dims: Sequence[Any], *, fn: Any, fn_t: Any, n_res: int, out_avals: Any, lin_avals: Any) -> Any:
        jnp = jax.numpy
        size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
        args = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims, strict=True)]
        res_axes = tuple(None if d is None else 0 for d in dims[:n_res])
        lin = tuple(
            jnp.broadcast_to(a, (size, *a.shape)) if d is None else a
            for a, d in zip(args[n_res:], dims[n_res:], strict=True)
        )

        def mapped(f: Any) -> Any:
            def g(r: tuple[Any, ...], x: tuple[Any, ...]) -> Any:
                return jax.vmap(f, in_axes=(res_axes, 0))(r, x)

            g.callee = getattr(f, "callee", None)  # type: ignore[attr-defined]
            return g

        def widen(avals: Any) -> tuple[Any, ...]:
            return tuple(jax.core.ShapedArray((size, *a.shape), a.dtype) for a in avals)

        out = prim.bind(
            *args[:n_res],
            *lin,
            fn=mapped(fn),
            fn_t=mapped(fn_t),
            n_res=n_res,
            out_avals=widen(out_avals),
            lin_avals=widen(lin_avals),
        )
        return out, [0] * len(out)

    prim.def_impl(impl)
    prim.def_abstract_eval(abstract)
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=True))
    ad.primitive_jvps[prim] = jvp
    ad.primitive_transposes[prim] = transpose
    batching.primitive_batchers[prim] = batch
    _LINEAR = prim
    return prim


def _never_compiling() -> bool:
    """A kernel's compile check until its torch op exists (before torch, nothing compiles)."""
    return False


def _make_pending_torch_ops() -> None:
    torch = sys.modules.get("torch")
    if torch is None:
        return
    while _PENDING_TORCH:
        try:
            k = _PENDING_TORCH.pop(0)
        except IndexError:  # another thread took the last one
            break
        if k._op is None:
            k._make_torch_op(torch)


def _jax_imported() -> Any:
    """jax, once its import is complete (a jax still being imported has no ``ffi`` yet)."""
    jax = sys.modules.get("jax")
    return jax if jax is not None and hasattr(jax, "ffi") else None


def _register_pending_jax_targets() -> None:
    jax = _jax_imported()
    if jax is None:
        return
    while _PENDING_JAX:
        try:
            k = _PENDING_JAX.pop(0)
        except IndexError:  # another thread took the last one
            break
        k._register_jax_target(jax)


def _after_jax_import() -> None:
    try:
        _register_pending_jax_targets()
    except Exception:  # noqa: BLE001 - never fail jax's import: the first traced call retries and raises
        pass


# What to do right after each watched module's own import.
_AFTER_IMPORT: dict[str, Callable[[], None]] = {"torch": _make_pending_torch_ops, "jax": _after_jax_import}


class _ImportHook:
    """A meta-path finder that acts right after torch's or jax's own import: it makes the pending
    torch ops, so a kernel made before torch was imported is a custom op by the time
    torch.compile traces it (dynamo cannot trace the op's creation), and registers the pending
    jax FFI targets, so a deserialized ``jax.export`` finds them."""

    def __init__(self) -> None:
        self.watched: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.watched:
            return None
        self.watched.discard(fullname)
        if not self.watched and self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec
        after = _AFTER_IMPORT[fullname]

        def exec_then_act(module: Any) -> None:
            exec_module(module)
            after()

        loader.exec_module = exec_then_act  # type: ignore[union-attr]
        return spec


_HOOK = _ImportHook()


def _watch_import(name: str) -> None:
    if name in sys.modules or name in _HOOK.watched:
        return
    _HOOK.watched.add(name)
    if _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)


def torch_ready() -> None:
    """Makes the torch ops of every kernel made before torch was imported (kernels made after
    make theirs at once, and any eager call makes the pending ones)."""
    _make_pending_torch_ops()


def kernel(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    namespace: str | None = None,
    out: str | Callable[..., tuple[Sequence[int], str]] | None = _UNSET,  # type: ignore[assignment]
    attrs: Mapping[str, str] | None = None,
    mutates: Sequence[str] = (),
    ffi: Any = None,
    backward: Any = None,
    vmap_method: str = "sequential",
    results: Sequence[str] | None = None,
    residuals: Sequence[str] = (),
    result_rule: Callable[..., Sequence[tuple[Sequence[int], str]]] | None = None,
    jvp: Any = None,
    optional: Sequence[str] = (),
    lists: Sequence[str] = (),
) -> Any:
    """Wraps ``fn`` into a :class:`Kernel` (usable as a decorator with keywords only). ``name``
    and ``namespace`` name its ops, ``torch.ops.<namespace>.<name>`` and the XLA FFI target
    ``<namespace>.<name>``; by default the function's name and the top-level package of its
    module. ``optional`` names the tensor parameters that may be None (``Tensor?``), ``lists``
    those that take a list or tuple of tensors (``Tensor[]``)."""

    def wrap(f: Callable[..., Any]) -> Kernel:
        return Kernel(
            f,
            name=name,
            namespace=namespace,
            out=out,
            attrs=attrs,
            mutates=mutates,
            ffi=ffi,
            backward=backward,
            vmap_method=vmap_method,
            results=results,
            residuals=residuals,
            result_rule=result_rule,
            jvp=jvp,
            optional=optional,
            lists=lists,
        )

    return wrap if fn is None else wrap(fn)
