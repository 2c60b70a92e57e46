"""Which exceptions become which HTTP errors: a ValueError is the request's fault (400),
anything else raised while serving it is the server's (500), never passed off as bad input."""

from __future__ import annotations

from http import HTTPStatus

from pagellm.engine.exceptions import EngineDeadError
from pagellm.entrypoints.openai.serving_engine import OpenAIError, as_openai_error


def test_value_error_is_a_400_with_its_message() -> None:
    err = as_openai_error(ValueError("max_tokens must be at least 1, got 0."))
    assert err.status == HTTPStatus.BAD_REQUEST and err.message == "max_tokens must be at least 1, got 0."
    assert err.response().model_dump()["error"]["type"] == "BadRequestError"


def test_type_error_is_an_internal_error() -> None:
    err = as_openai_error(TypeError("unsupported operand type(s) for +: 'int' and 'str'"))
    assert err.status == HTTPStatus.INTERNAL_SERVER_ERROR
    assert err.message == "Internal error: TypeError: unsupported operand type(s) for +: 'int' and 'str'"


def test_engine_death_is_a_503_and_openai_errors_pass_through() -> None:
    assert as_openai_error(EngineDeadError()).status == HTTPStatus.SERVICE_UNAVAILABLE
    mine = OpenAIError("nope", HTTPStatus.NOT_FOUND, "model")
    assert as_openai_error(mine) is mine
