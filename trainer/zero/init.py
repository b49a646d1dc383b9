"""``zero.Init``: build a model without materialising it, then fill it unit by unit.

Inside ``with trainer.zero.Init(config_dict_or_path=cfg):`` every
``nn.Parameter`` created is moved to the ``meta`` device the moment it is
made: the tensor the module allocated (``torch.empty``) is dropped before
anything touches its pages, and the module's own init at construction
(``reset_parameters``, HF ``post_init``) runs on meta tensors, i.e. does
nothing. Buffers stay real (they are small and some, like causal masks,
cannot be recomputed later).

``initialize`` then materialises the model one unit at a time, inside
``Engine._adopt_parameters`` (``materialise_unit``): the unit's meta
parameters get real CPU storage, the model's own init runs on the unit's
submodules (``param_init_fn(module)`` when given, else HF
``model._init_weights(module)``, else ``module.reset_parameters()`` or torch's
``_reset_parameters()``, children before parents as constructors run them) with
an RNG seeded from the unit's name (so it does not depend on rank or on
which units were materialised before), the engine broadcasts rank 0's
values and hands the partition to the backend, and stage 3 frees the full
tensors again. Peak rank memory during init is about one unit. When a
pretrained checkpoint is pending (``trainer.load_pretrained`` before
``initialize``, or ``from_pretrained`` under ``Init``: ``trainer.state.pretrained``),
rank 0 overwrites each freshly materialised unit from it, one tensor at a time.

While ``Init`` is active it also records where every module is registered
(torch's global module-registration hook): ``load_paths(module)`` gives the
module's dotted path in the model it was built in. A checkpoint loaded then
(``from_pretrained``) is keyed by those paths, and a wrapper applied before
``initialize`` re-parents modules (PEFT's ``base_model.model.`` prefix and
``.base_layer.`` infix, DDP's ``module.``, ``torch.compile``'s ``_orig_mod``)
without changing the module objects, so the checkpoint still finds them.

A wrapper may also add modules of its own and move them to the device of the
weights they wrap, which is ``meta`` here: PEFT builds and initialises its LoRA
adapters on CPU, then moves them to ``meta``, which drops their values. So from
the end of ``Init`` until ``initialize`` has materialised the model
(``release_kept_values``), the tensors of every module registered anywhere are
kept (``_keep_values``: a reference, no copy, while they stay where they are)
and ``materialise`` puts them back instead of running an init over them.

``GatheredParameters(params, modifier_rank=None)`` gathers engine-managed
parameters outside forward on every rank (collective) and, with
``modifier_rank``, scatters that rank's changes back into the partitions
and the fp32 master (in the rank or in the daemon). On parameters that are
still meta (before ``initialize``) it raises ``ZeroInitError``: there is
nothing to gather yet and an edit would be lost. (The ``deepspeed.zero``
facade that transformers' ZeRO-3 loading calls passes over them instead:
``initialize`` redoes that load, ``trainer.integrations.ds_facade.GatheredParameters``.)
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import json
import logging
import os
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook
from torch.nn.utils import parametrize
from torch.utils.hooks import RemovableHandle

from trainer.dist.agreement import agree
from trainer.dist.collectives import Collectives
from trainer.zero.partition import Unit

ParamInitFn = Callable[[nn.Module], None]

_ACTIVE: list[Init] = []
_original_param_new = nn.Parameter.__new__

ParentLinks = list[tuple["weakref.ref[nn.Module]", str]]
_PARENTS: weakref.WeakKeyDictionary[nn.Module, ParentLinks] = weakref.WeakKeyDictionary()
"""Module -> the (parent, attribute) places it was registered at while ``Init`` was active;
an empty list marks the root of a model built under ``Init`` (see ``load_paths``)."""
_registration_hook: list[RemovableHandle] = []
_KEPT: dict[int, tuple[weakref.ref[nn.Module], dict[str, torch.Tensor]]] = {}
"""id(module) -> (the module, its parameters' values by attribute when it was registered);
see ``_keep_values``."""
_keep_hook: list[RemovableHandle] = []


class ZeroInitError(RuntimeError):
    """A meta-built parameter could not be materialised; the message names the fix."""


def _meta_param_new(cls: type, data: torch.Tensor | None = None,
                    requires_grad: bool = True) -> nn.Parameter:
    constructed = None
    if _ACTIVE and data is not None and data.device.type != "meta":
        if data.numel() <= KEEP_CONSTRUCTED_NUMEL:
            constructed = data.detach().clone()
        data = data.to("meta")
    param: Any = _original_param_new(cls, data, requires_grad)
    if _ACTIVE and param.device.type == "meta":
        param._zero_init = _ACTIVE[-1]
        param._zero_constructed = constructed
    return param


KEEP_CONSTRUCTED_NUMEL = 1 << 16
"""Parameters up to this many elements keep the values they were constructed with
(``nn.Parameter(torch.tensor(2.66))``, ``torch.ones(dim)``), as an eager build does where
the model's init does not overwrite them (CLIP's ``logit_scale``); larger ones start
unset and must be written by an init or a checkpoint (``check_initialised``)."""


class Init:
    """DeepSpeed's ``deepspeed.zero.Init``: parameters built inside are meta until ``initialize``.

    ``config_dict_or_path`` is the engine config (dict or JSON path); it is
    checked to be a ZeRO config. ``param_init_fn(module)`` initialises one
    module's own parameters when the model has neither HF ``_init_weights``
    nor ``reset_parameters``. ``seed`` is the base of the per-unit seeds.
    ``enabled=False`` makes the context do nothing (as in DeepSpeed). ``module``, a model
    built already, needs nothing here: ``initialize`` partitions it as it is.
    """

    def __init__(self, module: nn.Module | None = None, *,
                 config_dict_or_path: dict[str, Any] | str | os.PathLike[str] | None = None,
                 config: dict[str, Any] | str | os.PathLike[str] | None = None,
                 param_init_fn: ParamInitFn | None = None, seed: int = 0,
                 enabled: bool = True, **_deepspeed_kwargs: Any) -> None:
        if module is not None:
            # DeepSpeed partitions a built model here; initialize does that with any model
            logging.getLogger("offloadd.zero").info(
                "zero.Init(module=%s): the built model is partitioned by initialize; its "
                "values are kept", type(module).__name__)
        source = config_dict_or_path if config_dict_or_path is not None else config
        if isinstance(source, (str, os.PathLike)):
            source = json.loads(Path(source).read_text(encoding="utf-8"))
        self.config = source
        self.param_init_fn = param_init_fn
        self.seed = seed
        self.enabled = enabled

    def __enter__(self) -> Init:
        if self.enabled:
            if not _ACTIVE:
                nn.Parameter.__new__ = staticmethod(_meta_param_new)  # type: ignore[assignment]
                _registration_hook.append(
                    register_module_module_registration_hook(_record_parent))
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            _ACTIVE.remove(self)
            if not _ACTIVE:
                nn.Parameter.__new__ = staticmethod(_original_param_new)  # type: ignore[method-assign]
                while _registration_hook:
                    _registration_hook.pop().remove()
                _settle_parents()
                if not _keep_hook:
                    _keep_hook.append(register_module_module_registration_hook(_keep_values))


# ---------------------------------------------------------------------------
# where modules were built (checkpoint names survive wrappers)


def _record_parent(parent: nn.Module, name: str, child: nn.Module | None) -> None:
    """torch's module-registration hook while ``Init`` is active: remember the place."""
    if child is not None:
        _PARENTS.setdefault(child, []).append((weakref.ref(parent), name))


def _settle_parents() -> None:
    """``Init`` ends: the model is built and this is the structure a checkpoint is loaded
    into. Drop places a module was registered at and then replaced in, and mark roots."""
    for child, links in list(_PARENTS.items()):
        links[:] = [(ref, name) for ref, name in links
                    if (parent := ref()) is not None and parent._modules.get(name) is child]
        for ref, _ in links:
            parent = ref()
            if parent is not None and parent not in _PARENTS:
                _PARENTS[parent] = []


def _keep_values(parent: nn.Module, name: str, child: nn.Module | None) -> None:
    """torch's module-registration hook between ``Init`` and ``initialize``: keep a
    reference to the values of the real parameters in the child's subtree, by module and
    attribute (a move to ``meta`` replaces the Parameter object), so that move loses
    nothing. A reference costs nothing while the parameter keeps its storage; a move
    elsewhere (``.to("cuda")``) keeps the old storage alive until ``release_kept_values``."""
    if child is None:
        return
    for module in child.modules():
        real = {attr: param.data for attr, param in module._parameters.items()
                if param is not None and not param.is_meta}
        key = id(module)
        if real and key not in _KEPT:
            _KEPT[key] = (weakref.ref(module, functools.partial(_forget_kept, key)), real)


def _forget_kept(key: int, _ref: object) -> None:
    """The module ``_keep_values`` kept values for is gone: so are they."""
    _KEPT.pop(key, None)


def _kept_values(root: nn.Module, wanted: dict[int, nn.Parameter]) -> dict[int, torch.Tensor]:
    """id(parameter) -> the values ``_keep_values`` kept for it, among ``wanted``."""
    found: dict[int, torch.Tensor] = {}
    for module in root.modules():
        kept = _KEPT.get(id(module))
        if kept is None or kept[0]() is not module:
            continue
        for attr, param in module._parameters.items():
            value = kept[1].get(attr)
            if (param is not None and id(param) in wanted and value is not None
                    and value.shape == param.shape):
                found[id(param)] = value
    return found


def release_kept_values() -> None:
    """``initialize`` has materialised its model: stop keeping values (``_keep_values``)."""
    while _keep_hook:
        _keep_hook.pop().remove()
    _KEPT.clear()


def load_paths(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """``(root, dotted path)`` of every place ``module`` had in the model it was built in
    under ``Init`` (the root's path is ``""``); empty for a module built elsewhere.

    These are the names ``from_pretrained`` loaded it under: a wrapper applied since (PEFT,
    DDP, ``torch.compile``) changes the module's current path, not these."""
    links = _PARENTS.get(module)
    if links is None:
        return []
    if not links:
        return [(module, "")]
    found: list[tuple[nn.Module, str]] = []
    for ref, name in links:
        parent = ref()
        if parent is None:
            continue
        found += [(root, f"{path}.{name}" if path else name) for root, path in load_paths(parent)]
    return found


# ---------------------------------------------------------------------------
# materialisation (called by the engine)


class WeightSource(Protocol):
    """Checkpoint values for freshly materialised tensors: the pretrained checkpoint a
    meta-built model is filled from (``trainer.state.pretrained.PretrainedSource``).

    Keyed by the tensors themselves (parameters) and by their owning module (buffers,
    which ``initialize`` replaces when it moves them), never by the model's current
    names: a wrapper may have renamed them since the checkpoint was matched."""

    def fill_param(self, param: torch.Tensor) -> bool:
        """Copy the checkpoint's value of ``param`` into it; False when it has none."""
        ...

    def fill_buffers(self, model: nn.Module) -> None:
        """Copy the checkpoint's value into every buffer of ``model`` it holds."""
        ...


def _fill(source: WeightSource, params: Sequence[torch.Tensor]) -> None:
    for param in params:
        source.fill_param(param)


def _post_order(module: nn.Module) -> list[nn.Module]:
    """Children before parents, as ``nn.Module.apply`` (HF ``post_init``) visits them."""
    order: list[nn.Module] = []
    for child in module.children():
        order += _post_order(child)
    order.append(module)
    return order


def _unit_seed(owner: Init | None, name: str) -> int:
    return ((owner.seed if owner is not None else 0) + zlib.crc32(name.encode())) % (2**63)


def materialise(model: nn.Module, root: nn.Module, params: Iterable[nn.Parameter],
                seed_name: str, device: torch.device | None = None) -> None:
    """Give the meta ``params`` real storage on ``device`` (default CPU) and run the
    model's init over ``root``'s subtree.

    The init visits the modules of ``root`` that hold one of ``params`` (directly or below),
    children first, then the enclosing modules whose constructor re-initialises below
    (``_reset_parameters``, torch's ``Transformer``); every other parameter there stands in
    as meta meanwhile (``_others_as_meta``), so the init writes only ``params``.
    """
    wanted = {id(p): p for p in params if p.device.type == "meta"}
    if not wanted:
        return
    kept = _kept_values(root, wanted)
    owner: Init | None = next((getattr(p, "_zero_init", None) for p in wanted.values()
                               if getattr(p, "_zero_init", None) is not None), None)
    custom = owner.param_init_fn if owner is not None else None
    path = _path_to(model, root, seed_name)
    init_fns = _hf_inits(path)
    to_init = {key: p for key, p in wanted.items() if key not in kept}
    modules = [m for m in _post_order(root) if any(id(p) in to_init for p in m.parameters())
               and not isinstance(m, parametrize.ParametrizationList)]  # set by their owner
    enclosing: list[nn.Module] = []  # torch's Transformer re-initialises its layers' matrices
    if custom is None and not any(_own_init(m) for m in path[:-1]):
        enclosing = [m for m in reversed(path[:-1]) if _own_reset(m, holds=False) is not None]
    modules += enclosing
    steps: list[Callable[[], None]] = []
    for module in modules:
        init_fn = custom or init_fns.get(id(module))
        originals = _originals(module)
        own = [*module.parameters(recurse=False), *originals]
        if init_fn is None:
            init_fn = _own_reset(module, any(id(p) in to_init for p in own))
        # a small parameter keeps what its constructor gave it (``KEEP_CONSTRUCTED_NUMEL``)
        if init_fn is None and any(id(p) in to_init and getattr(p, "_zero_constructed", None)
                                   is None for p in own):
            raise ZeroInitError(
                f"{type(module).__name__} was built under zero.Init but has no "
                f"reset_parameters() and no enclosing model has _init_weights(); pass "
                f"zero.Init(param_init_fn=...) to initialise it")
        if init_fn is None:
            continue
        if any(id(p) in to_init for p in originals):
            steps.append(functools.partial(_init_unparametrized, module, init_fn))
        else:
            steps.append(functools.partial(init_fn, module))
    for param in wanted.values():
        # A meta tensor cannot take CPU ``.data``; swapping keeps the Parameter object
        # (tied weights, the units' slots and the user's references all stay valid).
        real = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                            requires_grad=param.requires_grad)
        constructed = getattr(param, "_zero_constructed", None)
        if constructed is not None and constructed.shape == param.shape:
            real.data.copy_(constructed)
        elif real.is_floating_point():
            real.data.fill_(UNSET)  # what no init writes stays NaN (``check_initialised``)
        torch.utils.swap_tensors(param, real)
        param.__dict__.pop("_zero_constructed", None)  # used: the copy goes
    scope = enclosing[-1] if enclosing else root  # the outermost module an init runs on
    with torch.random.fork_rng(devices=[]), torch.no_grad(), _others_as_meta(scope, wanted):
        torch.manual_seed(_unit_seed(owner, seed_name))
        for step in steps:
            step()
        for key, value in kept.items():  # moved to meta after it was built: its own values
            wanted[key].copy_(value)


@contextlib.contextmanager
def _others_as_meta(scope: nn.Module, wanted: dict[int, nn.Parameter]) -> Iterator[None]:
    """Stand meta tensors of the full shape in for the real parameters under ``scope`` that
    are not ``wanted`` while the inits run: they write only the parameters being
    materialised.

    A module's parameters can sit in two units (parameter groups put a ``Linear``'s weight
    with the decayed and its bias with the rest): the unit materialised second runs the
    module's init again, and that init reads the other unit's parameter, already
    partitioned and released (``Linear.reset_parameters`` takes the bias bound from the
    weight's fan-in); a Transformer's init re-initialises every layer's matrices, of units
    already built. A meta stand-in answers shape questions and swallows the writes; the
    real parameter keeps the values its own unit's init gave it."""
    swapped: list[tuple[dict[str, Any], str, nn.Parameter]] = []
    for module in scope.modules():
        params = module.__dict__["_parameters"]
        for name, param in list(params.items()):
            if param is None or param.is_meta or id(param) in wanted:
                continue
            shape = getattr(param, "ds_shape", None) if param.numel() == 0 else None
            stand_in = nn.Parameter(
                torch.empty(param.shape if shape is None else shape, dtype=param.dtype,
                            device="meta"), requires_grad=param.requires_grad)
            dict.__setitem__(params, name, stand_in)
            swapped.append((params, name, param))
    try:
        yield
    finally:
        for params, name, param in swapped:
            dict.__setitem__(params, name, param)


def _own_reset(module: nn.Module, holds: bool = True) -> ParamInitFn | None:
    """The module's own init: ``reset_parameters`` where it ``holds`` parameters to
    initialise, or ``_reset_parameters``, which torch's constructors run
    (``nn.MultiheadAttention`` has only that; ``nn.Transformer``'s re-initialises what its
    layers built and ``MultiheadAttention``'s zeroes its ``out_proj`` bias: run after the
    children's, as the constructors did)."""
    for name in ("reset_parameters", "_reset_parameters")[0 if holds else 1:]:
        method = getattr(type(module), name, None)
        if callable(method):
            return method
    return None


def _parametrization_lists(module: nn.Module) -> list[nn.Module]:
    if not parametrize.is_parametrized(module):
        return []
    lists: nn.ModuleDict = module.parametrizations  # type: ignore[assignment]
    return list(lists.values())


UNSET = float("nan")
"""A materialised parameter's value until an init writes it."""


def _originals(module: nn.Module) -> list[nn.Parameter]:
    """The ``original*`` parameters behind ``module``'s parametrized tensors (weight norm)."""
    return [param for plist in _parametrization_lists(module)
            for param in plist.parameters(recurse=False)]


def _init_unparametrized(module: nn.Module, init_fn: ParamInitFn) -> None:
    """Run ``init_fn`` on ``module`` as it was before parametrization, then set its
    parametrized tensors from the values it wrote (each parametrization's
    ``right_inverse``: weight norm's magnitude and direction).

    Hazard: ``torch.nn.utils.parametrize`` gives the module a subclass whose properties
    compute the tensors from the originals; an init writing ``module.weight`` in place
    would write a temporary. DeepSpeed's zero.Init builds the plain weight first and
    parametrizes real values; here they are meta until now."""
    parametrized_class = type(module)
    with torch.no_grad():
        lists: nn.ModuleDict = module.parametrizations  # type: ignore[assignment]
        plain = {name: nn.Parameter(torch.empty_like(getattr(module, name))) for name in lists}
    module.__class__ = parametrized_class.__bases__[0]
    params = module.__dict__["_parameters"]
    params.update(plain)
    try:
        init_fn(module)
    finally:
        for name in plain:
            del params[name]
        module.__class__ = parametrized_class
    with torch.no_grad():
        for name, value in plain.items():
            setattr(module, name, value.detach())


def check_initialised(params: Iterable[torch.Tensor], where: str) -> None:
    """Refuse parameters no init wrote (still ``UNSET``): training would start from
    whatever bytes the allocator left there."""
    unset = [param for param in params if param.is_floating_point() and not param.is_meta
             and bool(torch.isnan(param).any())]
    if unset:
        names = ", ".join(f"{tuple(param.shape)}" for param in unset[:4])
        raise ZeroInitError(
            f"{len(unset)} parameter(s) of {where} built under zero.Init were not initialised "
            f"by the model's init (shapes {names}): no _init_weights branch, "
            f"reset_parameters() or checkpoint tensor covers them. Pass "
            f"zero.Init(param_init_fn=...) that initialises every parameter of a module, or "
            f"load pretrained weights that hold them")


def _path_to(model: nn.Module, root: nn.Module, root_name: str) -> list[nn.Module]:
    """``model``, the modules down to ``root`` (its dotted path ``root_name`` when that
    names it) and ``root``."""
    path = [model]
    if root is not model:
        try:
            found = model.get_submodule(root_name)
        except AttributeError:
            found = None
        if found is not root:  # a unit's name is its path; anything else is looked up
            root_name = next((name for name, module in model.named_modules() if module is root),
                             "")
        parts = root_name.split(".") if root_name else []
        path += [model.get_submodule(".".join(parts[:i])) for i in range(1, len(parts) + 1)]
        if path[-1] is not root:
            path.append(root)
    return path


def _hf_inits(path: list[nn.Module]) -> dict[int, ParamInitFn]:
    """Module -> the HF ``_init_weights`` of the outermost model enclosing it (itself
    included), for the subtree of ``path``'s last module (``_path_to``): the root's where
    it has one (an HF model, as always), else that of the HF model a wrapper holds (a
    LightningModule's ``configure_model``, a classifier around an HF backbone), not none."""
    root = path[-1]
    inherited: ParamInitFn | None = None
    for module in path[:-1]:
        inherited = inherited or _own_init(module)
    inits: dict[int, ParamInitFn] = {}

    def visit(module: nn.Module, current: ParamInitFn | None) -> None:
        current = current or _own_init(module)
        if current is not None:
            inits[id(module)] = current
        for child in module.children():
            visit(child, current)

    visit(root, inherited)
    return inits


def _own_init(module: nn.Module) -> ParamInitFn | None:
    init = getattr(module, "_init_weights", None)
    return init if callable(init) else None


def _return_free_heap() -> None:
    """Give glibc's freed heap pages back to the OS (``malloc_trim``).

    A unit's transient buffers (its parameters, flat copy, partition) are a few MiB each;
    once glibc's dynamic mmap threshold has grown past that size they come from the heap,
    and the freed holes pile up to about the model's size over a unit-by-unit init
    unless they are trimmed. Without glibc this does nothing.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    name = ctypes.util.find_library("c")  # runs ldconfig: once per process
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name is not None else None


def materialise_untracked(model: nn.Module, units: Sequence[Unit], collectives: Collectives,
                          pretrained: WeightSource | None = None) -> None:
    """Meta parameters outside every unit (frozen ones in stages 0-2): materialise them whole;
    rank 0 fills them (and the model's buffers) from ``pretrained`` before they are
    broadcast."""
    tracked = {id(slot.param) for unit in units for slot in unit.slots}
    rest = [p for p in model.parameters() if id(p) not in tracked]
    meta = {id(p) for p in rest if p.is_meta}
    built = _initialised_here([p for p in rest if id(p) in meta])
    materialise(model, model, rest, "<untracked>", collectives.device)
    if pretrained is not None:
        with agree(collectives, "loading pretrained weights outside the units"):
            if collectives.rank == 0:
                _fill(pretrained, built)
                pretrained.fill_buffers(model)
                check_initialised(built, "the parameters outside every unit")
    else:  # every rank ran the same seeded init: every rank finds the same
        check_initialised(built, "the parameters outside every unit")


def materialise_unit(model: nn.Module, unit: Unit, collectives: Collectives,
                     pretrained: WeightSource | None = None) -> None:
    """Engine hook, once per unit before its flat parameters are built. With ``pretrained``
    rank 0 overwrites the unit's freshly materialised parameters from the checkpoint (the
    engine broadcasts rank 0's values)."""
    meta = [slot.param for slot in unit.slots if slot.param.is_meta]
    if meta:
        _return_free_heap()  # the previous unit's buffers, before this unit's are allocated
    built = _initialised_here(meta)
    materialise(model, unit.module, [slot.param for slot in unit.slots], unit.name,
                collectives.device)
    if pretrained is not None and meta:
        with agree(collectives, f"loading pretrained weights into unit {unit.name}"):
            if collectives.rank == 0:
                _fill(pretrained, meta)
                check_initialised(built, f"unit {unit.name}")
    else:  # every rank ran the same seeded init: every rank finds the same
        check_initialised(built, f"unit {unit.name}")


# ---------------------------------------------------------------------------
# before initialize


def unmaterialise(param: nn.Parameter, shape: torch.Size, owner: Init) -> bool:
    """Make ``param`` a ``meta`` tensor of ``shape`` (a released stage-3 parameter is empty),
    as if ``owner`` had built it: the next ``initialize`` gives it storage with its unit
    (``owner``'s init, then rank 0's values broadcast over it). False, with ``param`` left
    as it was, where torch cannot swap it (someone holds a weak reference to it)."""
    meta = nn.Parameter(torch.empty(shape, dtype=param.dtype, device="meta"),
                        requires_grad=param.requires_grad)
    attributes = dict(param.__dict__)
    try:
        torch.utils.swap_tensors(param, meta)
    except RuntimeError:
        return False
    param.__dict__.update(attributes)
    param._zero_init = owner  # type: ignore[attr-defined]
    return True


def handover_owner() -> Init:
    """The ``Init`` of parameters an engine handed over ``meta``: no init of their own,
    since rank 0's values are broadcast over them."""
    return Init(config_dict_or_path={}, param_init_fn=_leave_uninitialised)


def _leave_uninitialised(_module: nn.Module) -> None:
    """``handover_owner``'s init: nothing (the broadcast fills the parameters)."""


def _initialised_here(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """Of meta ``params``, those an init here must give values (not a handover's, which
    rank 0's broadcast fills)."""
    return [param for param in params
            if getattr(getattr(param, "_zero_init", None), "param_init_fn", None)
            is not _leave_uninitialised]


def unmaterialised(param: torch.Tensor) -> bool:
    """Built under ``zero.Init`` and still on ``meta``: ``initialize`` gives it its values."""
    return param.is_meta and getattr(param, "_zero_init", None) is not None
