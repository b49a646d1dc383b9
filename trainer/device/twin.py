"""The strict device twin: on CPU, device memory is a kind of tensor of its own.

The twin copy engine (``trainer.device.copy_engine.TwinCopyEngine``) plays CUDA's copy
streams on a worker thread; with ``OFFLOADD_TWIN_DEVICE=strict`` the compute
device is ``twin:0`` as well, and its tensors refuse what CUDA refuses, so code
that would fail on a GPU fails here:

- ``twin`` is torch's PrivateUse1 device, renamed and set up as a Python
  backend; its only kernels are the allocators, which return ``DeviceTensor``:
  a CPU tensor whose Python type says "device memory". ``torch.empty(...,
  device=twin)``, ``tensor.to(twin)``, ``model.to(twin)`` (then ``adopt_module``)
  all give device tensors; ``.device`` reads ``twin:0``.
- An op that mixes a device tensor with a host tensor raises
  ``HostDeviceMixError``, except where CUDA allows it: 0-dim host tensors
  (scalars), ``copy_`` either way, host index tensors into device tensors.
- ``.numpy()``/``__array__`` raise ``HostOnlyCallError``; ``.cpu()`` and
  ``.to("cpu")`` give a host copy; a host check such as ``client.put``'s sees
  ``device.type == "twin"``.
- ``check_collective`` refuses host tensors on the device group, as NCCL does.

Hazard (what it cannot see): autograd's backward kernels run in C++, not
through ``__torch_function__``, so a host tensor captured by a custom backward
is not caught; gradients that reach Python (``param.grad``) are device tensors.
A tensor that comes back from C++ as a new object of the host type (a saved tensor
after ``save_on_cpu`` or reentrant checkpointing brought it back) is known by its
storage, which the twin's memory counts: it is a device tensor again at its first op
with one (``_is_host``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from trainer.device import twin_memory

TWIN_DEVICE_ENV = "OFFLOADD_TWIN_DEVICE"
TWIN_DEVICE_MODES = ("host", "strict")
TWIN_TYPE = "twin"
TWIN = torch.device("cpu")  # replaced by twin:0 once ``install`` ran
_installed = False
_install_lock = threading.Lock()
_library: Any = None  # the torch.library registration must live as long as the process


class HostDeviceMixError(RuntimeError):
    """An op mixed device (twin) tensors with host tensors, which CUDA refuses."""


class HostOnlyCallError(RuntimeError):
    """A host-only call (numpy, a buffer over the bytes) got a device (twin) tensor."""


def twin_device_mode() -> str:
    """``$OFFLOADD_TWIN_DEVICE``: host (twin copies, host tensors) | strict."""
    mode = os.environ.get(TWIN_DEVICE_ENV) or "host"
    if mode not in TWIN_DEVICE_MODES:
        raise ValueError(f"{TWIN_DEVICE_ENV}={mode!r}: expected one of "
                         f"{', '.join(TWIN_DEVICE_MODES)}")
    return mode


def twin_device() -> torch.device:
    """The twin's compute device, ``twin:0`` (sets the backend up on first use)."""
    install()
    return TWIN


def is_twin(device: torch.device | str | None) -> bool:
    """``device`` is the twin's (False before ``install``: no such device type yet)."""
    if not _installed or device is None:
        return False
    return torch.device(device).type == TWIN_TYPE


def is_device_tensor(tensor: Any) -> bool:
    return isinstance(tensor, DeviceTensor)


def install() -> None:
    """Rename PrivateUse1 to ``twin`` and register its allocators (once per process)."""
    global TWIN, _installed, _library
    with _install_lock:
        if _installed:
            return
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(rename=TWIN_TYPE, backend_module=_module())
        _library = torch.library.Library("aten", "IMPL")
        _library.impl("empty.memory_format", _empty, "PrivateUse1")
        _library.impl("empty_strided", _empty_strided, "PrivateUse1")
        TWIN = torch.device(TWIN_TYPE, 0)
        twin_memory.install()
        _compare_checkpoints_on_host()
        _installed = True


def _compare_checkpoints_on_host() -> None:
    """Activation checkpointing compares each recomputed saved tensor with the forward's
    (shape, dtype, device). Its recompute hook detaches what autograd saves inside a
    kernel, where the twin's dispatch is off, so recomputed tensors read as host tensors:
    a twin device and the host compare equal there (shape and dtype are still checked)."""
    from torch.utils import checkpoint

    default = checkpoint._DEFAULT_DETERMINISM_MODE
    extract = checkpoint._allowed_determinism_checks_to_fns[default]

    def metadata(tensor: torch.Tensor) -> Any:
        found = extract(tensor)
        if isinstance(found, dict) and getattr(found.get("device"), "type", None) == TWIN_TYPE:
            found["device"] = torch.device("cpu")
        return found

    checkpoint._allowed_determinism_checks_to_fns[default] = metadata


def _module() -> Any:
    """``torch.twin``: what torch asks a device's module (activation checkpointing asks
    for autocast's dtypes and the RNG state; benches for the memory figures)."""
    from torch.utils.backend_registration import _DummyBackendModule

    class TwinModule(_DummyBackendModule):
        memory_allocated = staticmethod(twin_memory.memory_allocated)
        max_memory_allocated = staticmethod(twin_memory.max_memory_allocated)
        reset_peak_memory_stats = staticmethod(twin_memory.reset_peak_memory_stats)
        mem_get_info = staticmethod(twin_memory.mem_get_info)

        @staticmethod
        def get_amp_supported_dtype() -> list[torch.dtype]:
            return [torch.float16, torch.bfloat16, torch.float32]

        @staticmethod
        def device(index: Any) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()  # one device

        # The twin's kernels draw from the host's generator (its state is the CPU's).
        get_rng_state = staticmethod(torch.get_rng_state)
        set_rng_state = staticmethod(torch.set_rng_state)

    return TwinModule()


def _empty(size: Any, dtype: Any = None, layout: Any = None, device: Any = None,
           pin_memory: Any = None, memory_format: Any = None) -> torch.Tensor:
    return _device(torch.empty(size, dtype=dtype))


def _empty_strided(size: Any, stride: Any, dtype: Any = None, layout: Any = None,
                   device: Any = None, pin_memory: Any = None) -> torch.Tensor:
    return _device(torch.empty_strided(size, stride, dtype=dtype))


def _device(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (a kernel's fresh result) as device memory, counted against the twin's
    capacity.

    Hazard: the tensor object itself changes type, where ``as_subclass`` would make an
    alias. An alias is a view of the fresh tensor, and a view keeps its base's storage
    after ``param.data = ...`` points it elsewhere: every parameter ZeRO-3 released
    would have kept its bytes, which CUDA frees."""
    twin_memory.memory().track(tensor)
    if type(tensor) is torch.Tensor:
        tensor.__class__ = DeviceTensor
        return tensor
    return tensor if isinstance(tensor, DeviceTensor) else tensor.as_subclass(DeviceTensor)


# ---------------------------------------------------------------------------
# the device tensor


def _tensors(values: Any) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, list | tuple):
            for item in value:
                if isinstance(item, torch.Tensor):
                    yield item


def _host_operand(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The first host tensor with data (not a 0-dim scalar) among the operands."""
    for tensor in _tensors(args):
        if _is_host(tensor):
            return tensor
    if kwargs:
        for tensor in _tensors(kwargs.values()):
            if _is_host(tensor):
                return tensor
    return None


def _is_host(tensor: torch.Tensor) -> bool:
    """A host tensor with data. A tensor object of the host type over device memory is a
    device tensor whose type was lost on a way through C++ (autograd hands saved tensors
    back so: ``save_on_cpu`` and checkpointing's unpack): it gets its type back, as on
    CUDA, where the device belongs to the memory and not to the Python object."""
    if isinstance(tensor, DeviceTensor) or not tensor.dim() or tensor.is_meta:
        return False
    if not twin_memory.memory().holds(tensor):
        return True
    if type(tensor) is torch.Tensor:
        tensor.__class__ = DeviceTensor
    elif type(tensor) is nn.Parameter:
        tensor.__class__ = DeviceParameter
    return False


def _refuse_mix(func: Any, host: torch.Tensor) -> HostDeviceMixError:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    return HostDeviceMixError(
        f"{name}: a {TWIN} tensor met a host tensor of shape {tuple(host.shape)} "
        f"({host.dtype}); CUDA refuses mixing devices in one op. Move it with "
        f".to(device) (a copy engine's h2d for arena bytes), or copy the result to the "
        f"host with .cpu()")


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor object for ``tensor``'s bytes (no copy)."""
    return torch.Tensor._make_subclass(torch.Tensor, tensor) if isinstance(
        tensor, DeviceTensor) else tensor


def _wrap(value: Any, args: tuple[Any, ...]) -> Any:
    if isinstance(value, torch.Tensor):
        for arg in args:  # an in-place op returns its (host or device) self unchanged
            if arg is value:
                return value
        return _device(value)
    if isinstance(value, tuple | list):
        return type(value)(_wrap(item, args) for item in value)
    return value


def _to_host(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        copied = tensor.to(dtype=dtype or tensor.dtype, copy=True)
    return _plain(copied)


def _to(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    self = args[0]
    options = dict(kwargs)
    copy = bool(options.pop("copy", False))
    device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **options)
    if device is not None and device.type == "cpu":
        return _to_host(self, dtype)
    if device is not None and device.type != TWIN_TYPE:
        raise HostDeviceMixError(f"the twin has no device {device}; use {TWIN} or cpu")
    with torch._C.DisableTorchFunctionSubclass():
        moved = self.to(dtype=dtype or self.dtype, copy=copy)
    return _wrap(moved, args)


def _set_data(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    self, value = args
    with torch._C.DisableTorchFunctionSubclass():
        func(self, value)
    if not isinstance(value, DeviceTensor):  # the tensor moved to the host
        self.__class__ = nn.Parameter if isinstance(self, nn.Parameter) else torch.Tensor
    return None


def _set_grad(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    self, value = args
    if value is not None and isinstance(self, DeviceTensor) != isinstance(value, DeviceTensor):
        raise HostDeviceMixError(
            f"assigned grad on {'host' if not isinstance(value, DeviceTensor) else TWIN} to a "
            f"tensor on {'host' if not isinstance(self, DeviceTensor) else TWIN}; CUDA refuses "
            "a gradient on another device than its tensor")
    with torch._C.DisableTorchFunctionSubclass():
        func(self, value)
    return None


def _index(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """CUDA indexes a device tensor with host index tensors, not a host tensor with device
    indices, and refuses a host value stored into a device tensor (and the reverse)."""
    self, index = args[0], args[1]
    operands = args[2:] if isinstance(self, DeviceTensor) else (index, *args[2:])
    for tensor in _tensors(operands):
        if isinstance(tensor, DeviceTensor) != isinstance(self, DeviceTensor) and tensor.dim():
            raise _refuse_mix(func, self if isinstance(tensor, DeviceTensor) else tensor)
    with torch._C.DisableTorchFunctionSubclass():
        result = func(*args, **kwargs)
    return _wrap(result, args) if isinstance(self, DeviceTensor) else result


def _host_only(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    raise HostOnlyCallError(
        f"can't convert {TWIN} device type tensor to numpy (or any host buffer), as CUDA "
        "refuses for cuda tensors; use Tensor.cpu() to copy the tensor to host memory first "
        "(or a copy engine's d2h into an arena lease)")


def _copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)  # host <-> device is what copy_ is for


def _deepcopy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``copy.deepcopy`` of device memory is device memory, as a CUDA tensor's copy is
    (Lightning's ModelCheckpoint deep-copies the logged metrics); torch's own needs a
    ``new_empty`` of the subclass, which the twin does not play."""
    self = args[0]
    memo = args[1] if len(args) > 1 else kwargs["memo"]
    if id(self) in memo:
        return memo[id(self)]
    if not self.is_leaf:
        raise RuntimeError("Only Tensors created explicitly by the user (graph leaves) "
                           "support the deepcopy protocol at the moment")
    with torch._C.DisableTorchFunctionSubclass():
        copied = self.detach().clone()
    copied.requires_grad_(self.requires_grad)
    result = _device(copied)
    memo[id(self)] = result
    return result


def _get_grad(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        value = func(*args, **kwargs)
    if value is None or isinstance(value, DeviceTensor) or not isinstance(args[0], DeviceTensor):
        return value
    return _device(value)


def _backward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``Tensor.backward``/``torch.autograd.backward`` with the subclass live: the hooks the
    backward runs (gradient reduction, copies to the arena) must see device tensors, not
    what the default handler's ``DisableTorchFunctionSubclass`` would give them."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    names = ("grad_tensors", "retain_graph", "create_graph", "inputs")
    options = dict(zip(names, args[1:], strict=False)) | kwargs
    if "gradient" in options:  # Tensor.backward's name for it
        options["grad_tensors"] = options.pop("gradient")
    outputs = args[0]
    tensors = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    inputs = options.get("inputs")
    inputs_tuple = () if inputs is None else (
        (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
    grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(options.get("grad_tensors"),
                                                             len(tensors)),
                        is_grads_batched=False)
    create_graph = bool(options.get("create_graph"))
    retain_graph = options.get("retain_graph")
    _engine_run_backward(tensors, grads, create_graph if retain_graph is None else retain_graph,
                         create_graph, inputs_tuple, allow_unreachable=True,
                         accumulate_grad=True)


def _histc(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """CUDA's ``histc`` counts integer tensors too; the CPU kernel refuses them, and code
    that sees a device that is not the CPU takes that path (transformers' MoE routing,
    ``integrations/moe.py``): count in fp32 and give the input's dtype, as CUDA does."""
    tensor = args[0]
    with torch._C.DisableTorchFunctionSubclass():
        counted = tensor if tensor.is_floating_point() else tensor.float()
        counts = func(counted, *args[1:], **kwargs).to(tensor.dtype)
    return _wrap(counts, args)


_RULES: dict[Any, Any] = {
    torch.histc: _histc,
    torch.Tensor.histc: _histc,
    torch.Tensor.backward: _backward,
    torch.autograd.backward: _backward,
    torch.Tensor.to: _to,
    torch.Tensor.cpu: lambda func, args, kwargs: _to_host(args[0], None),
    torch.Tensor.numpy: _host_only,
    torch.Tensor.__array__: _host_only,
    torch.Tensor.copy_: _copy,
    torch.Tensor.__deepcopy__: _deepcopy,
    torch.Tensor.data.__set__: _set_data,  # type: ignore[attr-defined]
    torch.Tensor.grad.__set__: _set_grad,  # type: ignore[union-attr]
    torch.Tensor.grad.__get__: _get_grad,  # type: ignore[union-attr]
    torch.Tensor._grad.__get__: _get_grad,  # type: ignore[union-attr]
    torch.Tensor.__getitem__: _index,
    torch.Tensor.__setitem__: _index,
    torch._has_compatible_shallow_copy_type: _copy,  # metadata only (Module.to asks it)
}


class DeviceTensor(torch.Tensor):
    """Bytes in the twin's device memory: a CPU tensor that refuses host operands."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return TWIN

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        rule = _RULES.get(func)
        if rule is not None:
            return rule(func, args, kwargs)
        host = _host_operand(func, args, kwargs)
        if host is not None:
            raise _refuse_mix(func, host)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        return _wrap(result, args)


class DeviceParameter(DeviceTensor, nn.Parameter):
    """A module parameter in the twin's device memory (``adopt_module`` makes them)."""


def adopt_module(module: nn.Module, *, count_params: bool = True) -> None:
    """After ``module.to(twin)``: its parameters and buffers become device tensors in place.

    ``Module.to`` sets ``param.data``, which keeps each Parameter object (tied weights and
    the caller's references stay valid) and so its host Python type; this gives each one
    the device type without a copy. ``count_params`` False: the parameters' bytes are
    still on the host (stage 3 copies each unit to the device and then points the
    parameters there; ``param.data = ...`` of a host parameter never reaches the twin's
    dispatch, so they take the device type now), so they are not counted as device
    memory."""
    for param in module.parameters():
        if type(param) is nn.Parameter and not param.is_meta:
            param.__class__ = DeviceParameter
            if count_params:
                twin_memory.memory().track(param)
            if param.requires_grad:  # autograd makes .grad in C++: count it once it lands
                param.register_post_accumulate_grad_hook(_count_grad)
    for owner in module.modules():
        for name, buffer in owner._buffers.items():
            if buffer is not None and type(buffer) is torch.Tensor and not buffer.is_meta:
                owner._buffers[name] = _device(buffer)


def _count_grad(param: torch.Tensor) -> None:
    param.grad  # noqa: B018 (reading it through the twin counts its storage)


def check_collective(device: torch.device, *tensors: torch.Tensor) -> None:
    """On the twin's device group every tensor must be device memory, as NCCL requires."""
    if device.type != TWIN_TYPE:
        return
    for tensor in tensors:
        if not isinstance(tensor, DeviceTensor):
            raise HostDeviceMixError(
                f"a host tensor of shape {tuple(tensor.shape)} ({tensor.dtype}) went to a "
                f"collective on the device group ({device}); NCCL takes device tensors "
                "only: create it with device=collectives.device (object collectives and "
                "barriers use the gloo side group)")


def check_copy(engine_device: torch.device, dst: torch.Tensor, src: torch.Tensor, *,
               direction: str) -> None:
    """A twin copy engine's h2d/d2h on the strict device: one side device, the other host."""
    if engine_device.type != TWIN_TYPE:
        return
    device_side, host_side = (dst, src) if direction == "h2d" else (src, dst)
    if not isinstance(device_side, DeviceTensor) or isinstance(host_side, DeviceTensor):
        way = "host -> device" if direction == "h2d" else "device -> host"
        raise HostDeviceMixError(
            f"{direction} copies {way}: got dst on {_where(dst)}, src on {_where(src)}; "
            "allocate device buffers with the copy engine's empty()")


def _where(tensor: torch.Tensor) -> str:
    return str(TWIN) if isinstance(tensor, DeviceTensor) else "host"
