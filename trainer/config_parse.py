"""How ``trainer.config.parse_config`` turns a DeepSpeed-style dict into keyword-only config
dataclasses: each section is built from its class's type hints, so a new field needs
nothing here.

On the way, unknown keys raise with a did-you-mean, renamed DeepSpeed keys
(``RENAMED_KEYS``) raise naming the new key, ignored keys are dropped and collected for one
warning, ``"auto"`` takes the default where it can be derived (``AUTO_DEFAULT_KEYS``), a
section's ``SPELLINGS`` and ``REFUSED`` apply, and each value is coerced to its field's
type. ``check_value`` is how every section refuses a value.

Below ``trainer.config`` and ``trainer.config_schedulers``, which import it; it imports
neither.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import types
import typing
import warnings
from collections.abc import Iterator
from typing import Any, Literal, Union

from trainer.deepspeed_features import (
    IGNORED_KEYS,
    SILENT_KEYS,
    check_type,
    check_unsupported,
    report_ignored,
    turns_on,
    unsupported_keys_under,
)

# Tuning knobs whose "auto" (Hugging Face configs) takes this engine's default.
AUTO_DEFAULT_KEYS = frozenset({
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.stage3_max_reuse_distance",
})

# Old DeepSpeed spellings that silently did nothing in some versions: refused
# here with the new name, so a typo'd config cannot run without its intent.
RENAMED_KEYS: dict[str, str] = {
    "optimizer.params.thread_count": "aio (ignored: the daemon owns IO threads)",
}
DEPRECATED_KEYS: dict[str, tuple[str, str]] = {
    "zero_optimization.cpu_offload": ("offload_optimizer", "a section"),
    "zero_optimization.cpu_offload_params": ("offload_param", "a section"),
    "zero_optimization.cpu_offload_use_pin_memory": ("", "ignored"),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": (
        "stage3_gather_16bit_weights_on_model_save", "renamed"),
    "bfloat16": ("bf16", "renamed"),
}
"""DeepSpeed's old names it still reads, as it reads them (its configs and tutorials carry
them: the CIFAR-10 one has ``"cpu_offload": false``), each with a warning naming the new
key. ``cpu_offload``/``cpu_offload_params`` true is ``{"device": "cpu"}`` in the new
section; ``cpu_offload_use_pin_memory`` DeepSpeed ignores; the others are renamed. Given
with their new key, they are refused."""


ELEMENT_COUNTS = frozenset({"zero_optimization.stage3_prefetch_bucket_size",
                            "zero_optimization.stage3_max_live_parameters",
                            "zero_optimization.stage3_max_reuse_distance"})
"""Sizes of the stage-3 prefetch heuristics, in elements: a fraction is rounded down. HF's
ZeRO-Inference example writes ``0.9 * hidden_size * hidden_size`` (DeepSpeed's pydantic
schema refuses it; HF's Trainer rounds its own "auto" value)."""


def check_value(ok: bool, key: str, value: object, accepted: str) -> None:
    """Raise ``ValueError`` naming the config key, its value and what it accepts, unless
    ``ok``."""
    if not ok:
        raise ValueError(f"config key {key}={value!r} is invalid: accepted {accepted}")


_IGNORED_SEEN: list[str] = []
"""Ignored keys that asked for something, met while the current config is parsed."""


@contextlib.contextmanager
def reporting_ignored() -> Iterator[None]:
    """Collect the ignored keys that asked for something while one config is parsed, and
    report them once (``report_ignored``) if it parses."""
    _IGNORED_SEEN.clear()
    try:
        yield
        report_ignored(list(_IGNORED_SEEN))
    finally:
        _IGNORED_SEEN.clear()


def nest_dotted_keys(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with each top-level key that spells a nested path with dots (TRL's
    ``prepare_deepspeed`` writes ``"zero_optimization.stage3_prefetch_bucket_size"`` so) put
    at that path. DeepSpeed never reads such keys (it passes over unknown top-level keys):
    here the value is used where the section does not set the key; where it does, the
    section's value stands, as in DeepSpeed, and a warning names both. The sections of
    ``data`` are copied, not changed."""
    nested = {key: value for key, value in data.items() if "." not in key}
    for key, value in data.items():
        if "." not in key:
            continue
        *path, leaf = key.split(".")
        section = nested
        for depth, part in enumerate(path):
            inner = section.get(part)
            if inner is not None and not isinstance(inner, dict):
                raise ValueError(f"config key {key}: {'.'.join(path[:depth + 1])} is not a "
                                 "section")
            section[part] = inner = dict(inner or {})
            section = inner
        if leaf not in section:
            section[leaf] = value
        elif section[leaf] != value:
            warnings.warn(f"config key {key!r} at the top level and {leaf!r} in its section "
                          f"are both set: the section's {section[leaf]!r} is used (DeepSpeed "
                          "reads only the section)", UserWarning, stacklevel=3)
    return nested


def flatten_typed_section(section: dict[str, Any], name: str) -> dict[str, Any]:
    """A ``{"type", "params"}`` section (``optimizer``, ``scheduler``) as one dict: its
    params, renamed and ignored keys handled, and its ``type``."""
    unknown = set(section) - {"type", "params"}
    if unknown:
        raise ValueError(f"unknown keys in {name}: {sorted(unknown)} (expected type, params)")
    check_type(name, section.get("type"))
    params = section.get("params") or {}
    if not isinstance(params, dict):
        raise ValueError(f"config key {name}.params must be an object")
    _reject_renamed_and_drop_ignored(params, f"{name}.params.")
    flat = {key: value for key, value in params.items() if key not in ("torch_adam",)}
    if "type" in section:
        flat["type"] = section["type"]
    return flat


def build_section(cls: type, data: dict[str, Any], prefix: str) -> Any:
    """``data``, the section at ``prefix`` ("" for the top level), as a ``cls``: each value
    coerced to its field's type, nested sections built in turn."""
    data = dict(data)
    _reject_renamed_and_drop_ignored(data, prefix)
    _respell(cls, data, prefix)
    _drop_auto(cls, data, prefix)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(_unknown_message(unknown, names, prefix))
    kwargs = {key: _coerce(hints[key], value, _key_path(prefix, key))
              for key, value in data.items()}
    return cls(**kwargs)


def _respell(cls: type, data: dict[str, Any], prefix: str) -> None:
    """Values a section accepts under DeepSpeed's other spellings (its ``SPELLINGS``,
    "bfloat16" for "bf16") become the spelling its field's ``Literal`` names; DeepSpeed
    values it refuses (its ``REFUSED``) raise ``ValueError`` saying why."""
    refused: dict[str, dict[str, str]] = getattr(cls, "REFUSED", {})
    for key, spellings in getattr(cls, "SPELLINGS", {}).items():
        value = data.get(key)
        if not isinstance(value, str):
            continue
        canonical = spellings.get(value, value)
        reason = refused.get(key, {}).get(canonical)
        if reason is not None:
            raise ValueError(f"config key {_key_path(prefix, key)}={value!r} is invalid: "
                             f"{reason}")
        data[key] = canonical


def _key_path(prefix: str, key: str) -> str:
    """The dotted key as the user wrote it: the optimizer and scheduler sections are
    parsed flattened, but their keys live under ``params``."""
    if prefix in ("optimizer.", "scheduler.") and key != "type":
        return f"{prefix}params.{key}"
    return prefix + key


def _translate_deprecated(data: dict[str, Any], prefix: str) -> None:
    """``DEPRECATED_KEYS`` in ``data`` (a copy of the section at ``prefix``) become their
    new keys, as DeepSpeed reads them."""
    for key in list(data):
        dotted = prefix + key
        if dotted not in DEPRECATED_KEYS:
            continue
        new, how = DEPRECATED_KEYS[dotted]
        value = data.pop(key)
        if new in data:
            raise ValueError(f"config keys {dotted} and {prefix}{new} are both set: "
                             f"{dotted} is DeepSpeed's old name, drop it")
        if how == "a section":
            check_value(isinstance(value, bool), dotted, value, "true or false")
            if value:
                data[new] = {"device": "cpu"}
            told = f"{prefix}{new}.device=\"cpu\"" if value else f"no {prefix}{new}"
        elif how == "renamed":
            data[new] = value
            told = prefix + new
        else:
            told = "nothing (DeepSpeed ignores it too)"
        warnings.warn(f"config key {dotted} is DeepSpeed's deprecated name: read as {told}",
                      UserWarning, stacklevel=4)


def _reject_renamed_and_drop_ignored(data: dict[str, Any], prefix: str) -> None:
    _translate_deprecated(data, prefix)
    check_unsupported(data, prefix)
    for key in list(data):
        dotted = prefix + key
        if dotted in RENAMED_KEYS:
            raise ValueError(f"config key {dotted} was renamed: use {RENAMED_KEYS[dotted]}")
        if dotted in IGNORED_KEYS:
            if dotted not in SILENT_KEYS and turns_on(data[key]) and (
                    dotted not in _IGNORED_SEEN):
                _IGNORED_SEEN.append(dotted)
            del data[key]


def _unknown_message(unknown: list[str], names: set[str], prefix: str) -> str:
    """Each unknown key with its likely intended one: a supported key, or a DeepSpeed
    feature offloadd lacks (so a typo of it is not mistaken for a missing feature)."""
    unsupported = set(unsupported_keys_under(prefix))
    parts = []
    for key in unknown:
        guess = difflib.get_close_matches(key, sorted(names | unsupported), n=1)
        hint = ""
        if guess:
            note = (", a DeepSpeed feature offloadd does not support"
                    if guess[0] in unsupported else "")
            hint = f" (did you mean {_key_path(prefix, guess[0])}{note}?)"
        parts.append(f"{_key_path(prefix, key)}{hint}")
    where = _key_path(prefix, "").rstrip(".") or "the top level"
    return f"unknown config keys in {where}: " + ", ".join(parts)


def _coerce(hint: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return value  # a section parsed ahead (the scheduler, by its type)
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if value is None:
            return None
        words = [word for arg in options if typing.get_origin(arg) is Literal
                 for word in typing.get_args(arg)]
        if words and isinstance(value, str):  # float | Literal["auto"]
            check_value(value in words, key, value, f"a number or {' or '.join(map(repr, words))}")
            return value
        return _coerce(options[0], value, key)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ValueError(f"config key {key} must be an object, got {value!r}")
        return build_section(typing.cast(type, hint), value, key + ".")
    if origin is Literal:
        choices = typing.get_args(hint)
        check_value(value in choices, key, value, "one of " + ", ".join(map(repr, choices)))
        return value
    if origin is tuple:
        return _coerce_tuple(hint, value, key)
    return _coerce_scalar(hint, value, key)


def _drop_auto(cls: type, data: dict[str, Any], prefix: str) -> None:
    """``"auto"`` (Hugging Face's DeepSpeed configs) means "derive it": accepted, as the
    key's default, where the default is derived here (unset batch sizes, arena size, ...)
    or is a tuning knob (``AUTO_DEFAULT_KEYS``); elsewhere the HF Trainer fills the value
    in from its TrainingArguments before DeepSpeed sees it, so it must be given."""
    hints = typing.get_type_hints(cls)
    for key in [key for key, value in data.items() if value == "auto" and key in hints]:
        dotted = _key_path(prefix, key)
        own = (hints[key], *typing.get_args(hints[key]))
        if any("auto" in typing.get_args(hint) for hint in own):
            continue  # "auto" is one of the key's own values (device, offload ratio)
        if type(None) in typing.get_args(hints[key]) or dotted in AUTO_DEFAULT_KEYS:
            del data[key]
            continue
        raise ValueError(f"config key {dotted}='auto' cannot be derived without the Hugging "
                         "Face Trainer (it fills 'auto' in from TrainingArguments): set a "
                         "value")


def _coerce_tuple(hint: Any, value: Any, key: str) -> tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"config key {key} must be a list, got {value!r}")
    args = typing.get_args(hint)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_coerce(args[0], item, key) for item in value)
    check_value(len(value) == len(args), key, value, f"a list of {len(args)} values")
    return tuple(_coerce(arg, item, key) for arg, item in zip(args, value, strict=True))


def _coerce_scalar(hint: Any, value: Any, key: str) -> Any:
    if hint is bool:
        check_value(isinstance(value, bool), key, value, "true or false")
        return value
    if hint is int:
        # DeepSpeed configs often spell counts as 5e8; accept integral floats.
        integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if key in ELEMENT_COUNTS and isinstance(value, float) and value >= 0:
            integral, value = True, math.floor(value)
        check_value(integral and not isinstance(value, bool), key, value, "an integer")
        return int(value)
    if hint is float:
        check_value(isinstance(value, (int, float)) and not isinstance(value, bool), key, value,
                    "a number")
        return float(value)
    if hint is str:
        check_value(isinstance(value, str), key, value, "a string")
        return value
    raise TypeError(f"unsupported config field type {hint!r} for {key}")
