"""A strict cattrs converter and the translation of its errors into YAML-path messages."""

from __future__ import annotations

import typing
from typing import Any

import attrs
import cattrs
from cattrs.errors import ForbiddenExtraKeysError

from posttrain.config.device_mapping import DeviceMappingError, parse_device_mapping
from posttrain.config.report import ErrorReport, did_you_mean, join_path


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

    # cattrs builds a list from any iterable: a string would become a list of its characters.
    def _list_hook_factory(tp: Any):
        try:
            from cattrs.cols import list_structure_factory

            inner = list_structure_factory(tp, conv)
        except ImportError:  # cattrs < 24.1
            inner = conv._structure_list

        def hook(value: Any, _type: Any):
            if not isinstance(value, list | tuple):
                raise _TypeMismatch("a list", value)
            return inner(value, _type)

        return hook

    conv.register_structure_hook_factory(_is_list, _list_hook_factory)

    def _mapping_for_class(cls: type) -> bool:
        return attrs.has(cls)

    # Classes must be built from mappings: a scalar where a section belongs is a clear error.
    def _class_hook_factory(cls: type):
        inner = cattrs.gen.make_dict_structure_fn(cls, conv, _cattrs_forbid_extra_keys=True)

        def hook(value: Any, _type: Any):
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


def _report_errors(exc: BaseException, cls: Any, path: str, report: ErrorReport) -> None:
    if isinstance(exc, ForbiddenExtraKeysError):
        fields = [f.name for f in attrs.fields(exc.cl)] if attrs.has(exc.cl) else []
        for key in sorted(exc.extra_fields):
            report.error(join_path(path, key), "unknown key", did_you_mean(key, fields))
        return
    children = getattr(exc, "exceptions", None)
    if children is not None and isinstance(exc, cattrs.BaseValidationError):
        for child in children:
            sub_path, sub_type = path, None
            for note in getattr(child, "__notes__", []) or []:
                name = getattr(note, "name", None)
                index = getattr(note, "index", None)
                if name is not None:
                    sub_path, sub_type = join_path(path, name), getattr(note, "type", None)
                elif index is not None:
                    sub_path, sub_type = join_path(path, index), getattr(note, "type", None)
            _report_errors(child, sub_type, sub_path, report)
        return
    report.error(path, _leaf_message(exc, cls), _leaf_hint(exc, cls))


def _literal_choices(tp: Any) -> tuple | None:
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)
    return None


def _leaf_message(exc: BaseException, tp: Any) -> str:
    choices = _literal_choices(tp)
    if choices is not None:
        return "invalid value; expected one of: " + ", ".join(map(str, choices))
    if isinstance(exc, KeyError):
        return "required key is missing"
    if isinstance(exc, _TypeMismatch):
        return str(exc)
    if isinstance(exc, ValueError | TypeError):
        return f"invalid value ({exc})"
    return f"{type(exc).__name__}: {exc}"


def _leaf_hint(exc: BaseException, tp: Any) -> str:
    choices = _literal_choices(tp)
    if choices is not None:
        value = str(exc).split(" not in literal")[0]
        hint = did_you_mean(value, [str(c) for c in choices])
        return hint if hint.startswith("did you mean") else ""  # the message lists the choices
    if isinstance(exc, _TypeMismatch) and "device indices" in str(exc):
        cause = exc.__cause__
        return f"{cause}; e.g. [0, 1] or 'list(range(0, 8))'" if cause else ""
    return ""
