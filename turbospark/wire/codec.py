"""The one cattrs converter, and the codec boundary.

Strict primitive hooks: cattrs' defaults coerce (``"false"`` becomes True, ``2.7`` becomes 2,
``5`` becomes ``"5"``); a wire API must refuse those instead.  Unknown keys are refused
(``forbid_extra_keys``), so a misspelled parameter is named in a 400 instead of silently ignored.
cattrs reports validation failures as exception groups; ``structure`` turns them into one plain
``RequestInvalid`` whose message names every path that was wrong.
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeVar

import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError
from cattrs.v import format_exception, transform_error

from ..errors import RequestInvalid

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


MAX_DEPTH = 64  # arrays and objects inside each other; real requests nest a dozen levels
MAX_NUMBER_CHARS = 40  # a u64 seed has 20 digits; thousands of digits are an attack on int()


def _no_constant(name: str) -> Any:
    raise RequestInvalid(f"the request body is not valid JSON: {name} is not a JSON number")


def _int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise RequestInvalid(f"the request body holds a number of {len(text)} digits; at most {MAX_NUMBER_CHARS} are accepted")
    return int(text)


def _float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS * 8:
        raise RequestInvalid(f"the request body holds a number of {len(text)} characters")
    value = float(text)
    if math.isinf(value):
        raise RequestInvalid(f"the request body holds a number too large for a double: {text[:40]}")
    return value


def _check(value: Any) -> None:
    """Nesting depth, and strings that cannot be UTF-8 (a lone UTF-16 surrogate from a
    ``\\ud800`` escape), everywhere in a decoded body; iterative, so depth costs no stack."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _utf8(item)
        elif isinstance(item, (dict, list)):
            if depth > MAX_DEPTH:
                raise RequestInvalid(f"the request body nests arrays and objects more than {MAX_DEPTH} deep")
            if isinstance(item, dict):
                for key, v in item.items():
                    _utf8(key)
                    stack.append((v, depth + 1))
            else:
                stack.extend((v, depth + 1) for v in item)


def _utf8(text: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestInvalid(
                "the request body holds a string with a lone UTF-16 surrogate, which is not valid Unicode"
            ) from None


def parse_json(data: bytes) -> Any:
    """Decode a request body, refusing anything that is not JSON, and JSON a careful server
    does not take: NaN and Infinity, numbers of more than 40 digits, nesting more than 64 deep,
    lone surrogates."""
    try:
        value = json.loads(data, parse_constant=_no_constant, parse_int=_int, parse_float=_float)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestInvalid(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise RequestInvalid(f"the request body nests arrays and objects more than {MAX_DEPTH} deep") from None
    except ValueError as exc:  # int() refusing a number
        raise RequestInvalid(f"the request body holds a number this server does not accept: {exc}") from None
    _check(value)
    return value


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
