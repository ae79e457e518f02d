"""The error-code registry (``vitembed.server.errors.ERROR_CODES``) is complete: every code the server can
answer with, found in the source, is registered with the status it is sent with. The client's mapping is
checked against the same registry (tests/client/test_errors.py), so a new code without its two lines fails.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from vitembed.server import app  # noqa: F401  (every router: every error class the routes raise)
from vitembed.server.errors import _HTTP_CODES, CLIENT_CLOSED, DECODE_STATUS, ERROR_CODES, status_for

from vit_backbone.errors import VitEmbedError

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [
    *sorted((ROOT / "service" / "vitembed").rglob("*.py")),
    *sorted((ROOT / "vit_backbone").rglob("*.py")),
]
NAMED_STATUSES = {"CLIENT_CLOSED": CLIENT_CLOSED}


def _status(node: ast.expr) -> int | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        return NAMED_STATUSES.get(node.id)
    return None


def _calls() -> Iterator[tuple[str, ast.Call]]:
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                yield f"{path.relative_to(ROOT)}:{node.lineno}", node


def _name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _error_classes() -> dict[str, type[VitEmbedError]]:
    found: dict[str, type[VitEmbedError]] = {}
    stack: list[type[VitEmbedError]] = [VitEmbedError]
    while stack:
        cls = stack.pop()
        found[cls.__name__] = cls
        stack.extend(cls.__subclasses__())
    return found


def _http_status(cls: type[VitEmbedError], code: str) -> int:
    error = cls.__new__(cls)
    error.code = code
    return status_for(error)


def test_every_code_the_service_sends_is_registered_with_its_status() -> None:
    sent: dict[str, set[int]] = {}
    for where, call in _calls():
        name = _name(call)
        if name in (
            "ApiError",
            "error_response",
        ):  # ApiError(status, code, ...) / error_response(scope, status, code)
            args = call.args if name == "ApiError" else call.args[1:]
            if len(args) >= 2 and isinstance(args[1], ast.Constant) and isinstance(args[1].value, str):
                status = _status(args[0])
                assert status is not None, f"{where}: a status the test cannot read"
                sent.setdefault(args[1].value, set()).add(status)
    classes = _error_classes()
    for cls in classes.values():  # library errors by class code
        status = _http_status(cls, cls.code)
        if status != 500:  # 500s leave as the generic "internal"
            sent.setdefault(cls.code, set()).add(status)
    for _where, call in _calls():  # library errors raised with another code=
        cls = classes.get(_name(call))
        for keyword in call.keywords:
            if cls is not None and keyword.arg == "code" and isinstance(keyword.value, ast.Constant):
                status = _http_status(cls, str(keyword.value.value))
                if status != 500:
                    sent.setdefault(str(keyword.value.value), set()).add(status)
    for status, code in _HTTP_CODES.items():
        sent.setdefault(code, set()).add(status)
    assert len(sent) > 30  # the scan found the service's codes
    missing = sorted(code for code in sent if code not in ERROR_CODES)
    assert missing == [], f"codes the server sends but ERROR_CODES lacks: {missing}"
    wrong = {code: statuses for code, statuses in sent.items() if statuses != {ERROR_CODES[code]}}
    assert wrong == {}, "codes sent with another status than the registry's"


def test_registry_holds_the_decode_codes_and_the_generic_ones() -> None:
    assert {code: ERROR_CODES[code] for code in DECODE_STATUS} == dict(DECODE_STATUS)
    assert ERROR_CODES["internal"] == 500 and ERROR_CODES["queue_full"] == 429
    assert all(400 <= status <= 599 for status in ERROR_CODES.values())
