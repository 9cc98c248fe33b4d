"""A strict cattrs converter and the translation of its errors into YAML-path messages."""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import attrs
import cattrs
from cattrs.errors import ForbiddenExtraKeysError

from posttrain.config.device_mapping import DeviceMappingError, parse_device_mapping
from posttrain.config.ranges import OutOfRange, Range, range_of
from posttrain.config.report import ErrorReport, did_you_mean, join_path

# A structure hook: (value, type) -> the structured value.
_Hook = Callable[[Any, Any], Any]


class _TypeMismatch(TypeError):
    def __init__(self, expected: str, value: Any):
        super().__init__(f"expected {expected}, got {_describe(value)}")


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"


def _quote(value: Any) -> str:
    """A value as the YAML had it: 'k4', 3, true, null (long ones cut)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _strict_int(value: Any, _type: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _TypeMismatch("an integer", value)
    return value


def _strict_float(value: Any, _type: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _TypeMismatch("a number", value)
    return float(value)


def _strict_bool(value: Any, _type: Any) -> bool:
    if not isinstance(value, bool):
        raise _TypeMismatch("true or false", value)
    return value


def _strict_str(value: Any, _type: Any) -> str:
    if not isinstance(value, str):
        raise _TypeMismatch("a string", value)
    return value


class _NotAChoice(ValueError):
    def __init__(self, value: Any, choices: tuple):
        super().__init__(f"{value!r} is not one of {choices!r}")
        self.value = value
        self.choices = choices


def _literal(value: Any, type_: Any) -> Any:
    # Equal is not enough: True == 1 would let `true` pass for a choice of 1 or 2.
    choices = typing.get_args(type_)
    if any(value == c and type(value) is type(c) for c in choices):
        return value
    raise _NotAChoice(value, choices)


def _device_mapping(value: Any, _type: Any) -> tuple[int, ...]:
    try:
        return parse_device_mapping(value)
    except DeviceMappingError as exc:
        raise _TypeMismatch(
            "a list of distinct device indices or 'list(range(a, b))'", value
        ) from exc


def _strict_dict(value: Any, type_: Any) -> dict:
    if not isinstance(value, dict):
        raise _TypeMismatch("a mapping", value)
    return dict(value)


def _is_list(tp: Any) -> bool:
    return typing.get_origin(tp) is list


def make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    conv.register_structure_hook(int, _strict_int)
    conv.register_structure_hook(float, _strict_float)
    conv.register_structure_hook(bool, _strict_bool)
    conv.register_structure_hook(str, _strict_str)
    conv.register_structure_hook_func(lambda t: t == tuple[int, ...], _device_mapping)
    conv.register_structure_hook_func(lambda t: t == dict[str, Any], _strict_dict)
    conv.register_structure_hook_func(lambda t: typing.get_origin(t) is typing.Literal, _literal)

    # cattrs builds a list from any iterable: a string would become a list of its characters.
    def _list_hook_factory(tp: Any) -> _Hook:
        try:
            from cattrs.cols import list_structure_factory

            inner: _Hook = list_structure_factory(tp, conv)
        except ImportError:  # cattrs < 24.1
            # The installed cattrs (>= 24.1), whose types mypy reads, no longer has it.
            inner = conv._structure_list  # type: ignore[attr-defined]

        def hook(value: Any, _type: Any) -> Any:
            if not isinstance(value, list | tuple):
                raise _TypeMismatch("a list", value)
            return inner(value, _type)

        return hook

    conv.register_structure_hook_factory(_is_list, _list_hook_factory)

    def _mapping_for_class(cls: type) -> bool:
        return attrs.has(cls)

    # A field with a Range (posttrain.config.ranges) is checked as it is structured, not by
    # the class's validator in __init__: that one would stop at the first bad field and name the
    # class, not the field.
    def _ranged_hook(field_type: Any, allowed: Range) -> _Hook:
        structure = conv.get_structure_hook(field_type)

        def hook(value: Any, _type: Any) -> Any:
            structured = structure(value, field_type)
            if structured is not None and not allowed.admits(structured):
                raise OutOfRange(value, allowed)  # as written: 0, not the float hook's 0.0
            return structured

        return hook

    # Classes must be built from mappings: a scalar where a section belongs is a clear error.
    def _class_hook_factory(cls: type) -> _Hook:
        attrs.resolve_types(cls)
        # Any values: mypy would match the overrides against make_dict_structure_fn's own
        # keyword parameters (its bool flags), which no field name reaches.
        ranged: dict[str, Any] = {
            f.name: cattrs.gen.override(struct_hook=_ranged_hook(f.type, allowed))
            for f in attrs.fields(cls)
            if (allowed := range_of(f)) is not None
        }
        inner: _Hook = cattrs.gen.make_dict_structure_fn(
            cls, conv, _cattrs_forbid_extra_keys=True, **ranged
        )

        def hook(value: Any, _type: Any) -> Any:
            if not isinstance(value, dict):
                raise _TypeMismatch("a mapping", value)
            return inner(value, _type)

        return hook

    conv.register_structure_hook_factory(_mapping_for_class, _class_hook_factory)
    return conv


CONVERTER = make_converter()


def structure_into(data: Any, cls: type, path: str, report: ErrorReport) -> Any | None:
    """Structure ``data`` into ``cls``; on failure add every error to ``report`` and return None."""
    try:
        return CONVERTER.structure(data, cls)
    except Exception as exc:  # cattrs raises validation groups; translated below, never hidden
        _report_errors(exc, cls, path, report)
        return None


def _report_errors(
    exc: BaseException,
    cls: Any,
    path: str,
    report: ErrorReport,
    field: attrs.Attribute | None = None,
) -> None:
    if isinstance(exc, ForbiddenExtraKeysError):
        fields = [f.name for f in attrs.fields(exc.cl)] if attrs.has(exc.cl) else []
        for key in sorted(exc.extra_fields):
            report.error(join_path(path, key), "unknown key", did_you_mean(key, fields))
        return
    children = getattr(exc, "exceptions", None)
    if children is not None and isinstance(exc, cattrs.BaseValidationError):
        owner = getattr(exc, "cl", None)
        for child in children:
            sub_path, sub_type, sub_field = path, None, None
            for note in getattr(child, "__notes__", []) or []:
                name = getattr(note, "name", None)
                index = getattr(note, "index", None)
                if name is not None:
                    sub_path, sub_type = join_path(path, name), getattr(note, "type", None)
                    if owner is not None and attrs.has(owner):
                        sub_field = attrs.fields_dict(owner).get(name)
                elif index is not None:
                    sub_path, sub_type = join_path(path, index), getattr(note, "type", None)
            _report_errors(child, sub_type, sub_path, report, sub_field)
        return
    report.error(path, _leaf_message(exc, cls), _leaf_hint(exc, field))


def _leaf_message(exc: BaseException, tp: Any) -> str:
    if isinstance(exc, _NotAChoice):
        choices = ", ".join(map(str, exc.choices))
        if type(None) in typing.get_args(tp):  # Literal[...] | None
            choices += ", or null"
        return f"invalid value {_quote(exc.value)}; expected one of: {choices}"
    if isinstance(exc, OutOfRange):
        return exc.detail
    if isinstance(exc, KeyError):
        return "required key is missing"
    if isinstance(exc, _TypeMismatch):
        return str(exc)
    if isinstance(exc, ValueError | TypeError):
        return f"invalid value ({exc})"
    return f"{type(exc).__name__}: {exc}"


def _leaf_hint(exc: BaseException, field: attrs.Attribute | None) -> str:
    if isinstance(exc, _NotAChoice):
        hint = did_you_mean(str(exc.value), [str(c) for c in exc.choices])
        return hint if hint.startswith("did you mean") else ""  # the message lists the choices
    if isinstance(exc, OutOfRange) and field is not None:
        return _default_hint(field, exc.allowed)
    if isinstance(exc, _TypeMismatch) and "device indices" in str(exc):
        cause = exc.__cause__
        return f"{cause}; e.g. [0, 1] or 'list(range(0, 8))'" if cause else ""
    return ""


def _default_hint(field: attrs.Attribute, allowed: Range) -> str:
    """Point at the field's default as a value that is surely allowed."""
    default = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        return ""
    if default is None:
        return "or null, the default"
    if default is not attrs.NOTHING and allowed.admits(default):
        return f"e.g. {default!r}, the default"
    return ""
