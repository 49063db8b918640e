"""The one cattrs converter, and the codec boundary.

Strict primitive hooks: cattrs' defaults coerce (``"false"`` becomes True, ``2.7`` becomes 2,
``5`` becomes ``"5"``); a wire API must refuse those instead.  Unknown keys are refused
(``forbid_extra_keys``), so a misspelled parameter is named in a 400 instead of silently ignored.
cattrs reports validation failures as exception groups; ``structure`` turns them into one plain
``RequestInvalid`` whose message names every path that was wrong.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError
from cattrs.v import format_exception, transform_error

from .errors import RequestInvalid

__all__ = ["converter", "parse_json", "structure"]

T = TypeVar("T")


def _strict_bool(value: Any, _: type) -> bool:
    if isinstance(value, bool):
        return value
    raise TypeError(f"expected a boolean, got {type(value).__name__}")


def _strict_int(value: Any, _: type) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise TypeError(f"expected an integer, got {_describe(value)}")


def _strict_float(value: Any, _: type) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"expected a number, got {_describe(value)}")


def _strict_str(value: Any, _: type) -> str:
    if isinstance(value, str):
        return value
    raise TypeError(f"expected a string, got {_describe(value)}")


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    return type(value).__name__


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True, omit_if_default=False)
    conv.register_structure_hook(bool, _strict_bool)
    conv.register_structure_hook(int, _strict_int)
    conv.register_structure_hook(float, _strict_float)
    conv.register_structure_hook(str, _strict_str)
    conv.register_structure_hook(Any, lambda v, _: v)
    return conv


converter = _make_converter()


def _format_one(exc: BaseException, type_: type | None) -> str:
    if isinstance(exc, ForbiddenExtraKeysError):
        return "unknown field(s) " + ", ".join(sorted(exc.extra_fields))
    text = str(exc)
    if " not in literal " in text:
        value, _, allowed = text.partition(" not in literal ")
        choices = allowed.removeprefix("typing.Literal[").removesuffix("]")
        return f"'{value}' is not one of {choices}"
    if isinstance(exc, (ValueError, TypeError)) and text:
        return text
    return format_exception(exc, type_)


def _format(exc: BaseException) -> str:
    if isinstance(exc, ForbiddenExtraKeysError):
        return _format_one(exc, None)
    messages = transform_error(exc, path="body", format_exception=_format_one)  # type: ignore[arg-type]
    return "; ".join(messages)


def parse_json(data: bytes) -> Any:
    """Decode a request body, refusing anything that is not JSON."""
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestInvalid(f"the request body is not valid JSON: {exc}") from exc


def structure(data: Any, cls: type[T]) -> T:
    """Build a wire type from decoded JSON; every failure is one ``RequestInvalid``."""
    if not isinstance(data, dict):
        raise RequestInvalid("the request body must be a JSON object")
    try:
        return converter.structure(data, cls)
    except ClassValidationError as exc:
        raise RequestInvalid(_format(exc)) from None
    except ForbiddenExtraKeysError as exc:
        raise RequestInvalid(_format(exc)) from None
    except (cattrs.BaseValidationError, ValueError, TypeError) as exc:
        raise RequestInvalid(f"invalid request: {exc}") from None
