"""OpenAI's files and batches endpoints over a `BatchStore`.

    POST   /v1/files                  multipart: purpose=batch, file=<JSONL>
    GET    /v1/files[?purpose&after&limit]   GET /v1/files/{id}   GET /v1/files/{id}/content
    DELETE /v1/files/{id}
    POST   /v1/batches                {input_file_id, endpoint, completion_window, metadata}
    GET    /v1/batches[?after&limit]  GET /v1/batches/{id}   POST /v1/batches/{id}/cancel

An upload is written to the store's directory as it is parsed (multipart parts larger than
1 MiB spool to disk, never whole in memory) and refused past `max_file_bytes` or
`max_lines`; a batch is refused at creation when its file repeats a `custom_id`. Lines are
otherwise checked when they run (a bad line is an error-file entry, never a failed batch).
Objects are only visible to their owner: the API key's owner id in
`scope["state"]["owner"]` (absent: "", everyone, when keys are off).
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import FastAPI
from starlette.datastructures import UploadFile
from starlette.requests import Request as HTTPRequest
from starlette.responses import FileResponse, JSONResponse, Response

from app.batch.runner import ENDPOINTS
from app.batch.store import FINAL, BatchRow, BatchStore, FileInUse, FileRow, new_id
from app.openai.body import parse_body
from app.openai.errors import APIError, bad_request
from app.settings import BatchSettings

_WINDOW = re.compile(r"^(\d{1,4})(h|m)$")
_MAX_LIMIT = 100


def install_batch_routes(app: FastAPI, store: BatchStore, settings: BatchSettings) -> None:
    app.state.batch = (store, settings)
    app.add_api_route("/v1/files", upload_file, methods=["POST"])
    app.add_api_route("/v1/files", list_files, methods=["GET"])
    app.add_api_route("/v1/files/{file_id}", get_file, methods=["GET"])
    app.add_api_route("/v1/files/{file_id}/content", file_content, methods=["GET"])
    app.add_api_route("/v1/files/{file_id}", delete_file, methods=["DELETE"])
    app.add_api_route("/v1/batches", create_batch, methods=["POST"])
    app.add_api_route("/v1/batches", list_batches, methods=["GET"])
    app.add_api_route("/v1/batches/{batch_id}", get_batch, methods=["GET"])
    app.add_api_route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"])


def _store(request: HTTPRequest) -> tuple[BatchStore, BatchSettings]:
    return request.app.state.batch


def owner_of(request: HTTPRequest) -> str:
    return str(request.scope.get("state", {}).get("owner", ""))


def _limit(request: HTTPRequest) -> int:
    raw = request.query_params.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= _MAX_LIMIT:
        raise bad_request(f"limit must be an integer in [1, {_MAX_LIMIT}]", "limit")
    return int(raw)


def _not_found(what: str, ident: str, param: str) -> APIError:
    return APIError(404, f"No {what} with id '{ident}' found.", param=param, code="not_found")


# -- objects -----------------------------------------------------------------------------------


def file_object(row: FileRow) -> dict[str, Any]:
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.bytes,
        "created_at": row.created_at,
        "filename": row.filename,
        "purpose": row.purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def batch_object(row: BatchRow) -> dict[str, Any]:
    times = row.times
    return {
        "id": row.id,
        "object": "batch",
        "endpoint": row.endpoint,
        "errors": None if not row.errors else {"object": "list", "data": row.errors},
        "input_file_id": row.input_file_id,
        "completion_window": row.completion_window,
        "status": row.status,
        "output_file_id": row.output_file_id,
        "error_file_id": row.error_file_id,
        "created_at": row.created_at,
        "in_progress_at": times.get("in_progress_at"),
        "expires_at": row.expires_at,
        "finalizing_at": times.get("finalizing_at"),
        "completed_at": times.get("completed_at"),
        "failed_at": times.get("failed_at"),
        "expired_at": times.get("expired_at"),
        "cancelling_at": times.get("cancelling_at"),
        "cancelled_at": times.get("cancelled_at"),
        "request_counts": {
            "total": row.total,
            "completed": row.completed,
            "failed": row.failed,
        },
        "metadata": row.metadata,
    }


def _page(data: list[dict[str, Any]], has_more: bool) -> JSONResponse:
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }
    )


# -- files ---------------------------------------------------------------------------------------


async def upload_file(request: HTTPRequest) -> Response:
    store, settings = _store(request)
    try:
        form = await request.form(max_files=1, max_fields=8)
    except Exception as exc:  # not multipart, or a malformed one
        raise bad_request(f"expected a multipart/form-data upload: {exc}", "file") from None
    try:
        purpose = form.get("purpose")
        upload = form.get("file")
        if purpose != "batch":
            raise bad_request("purpose must be 'batch'", "purpose")
        if not isinstance(upload, UploadFile):
            raise bad_request("a file part named 'file' is required", "file")
        file_id = new_id("file")
        path = store.file_path(file_id)
        part = path.with_suffix(".part")
        size = lines = 0
        try:
            with part.open("wb") as out:
                while chunk := await upload.read(1 << 20):
                    size += len(chunk)
                    if size > settings.max_file_bytes:
                        raise bad_request(
                            f"the file is larger than {settings.max_file_bytes} bytes", "file"
                        )
                    lines += chunk.count(b"\n")
                    if lines > settings.max_lines:
                        raise bad_request(
                            f"the file has more than {settings.max_lines} lines", "file"
                        )
                    out.write(chunk)
            part.replace(path)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        filename = upload.filename or f"{file_id}.jsonl"
        row = store.add_file(file_id, owner_of(request), filename, "batch", size, lines)
    finally:
        await form.close()
    return JSONResponse(file_object(row))


async def list_files(request: HTTPRequest) -> Response:
    store, _ = _store(request)
    rows, more = store.list_files(
        owner_of(request),
        request.query_params.get("purpose"),
        request.query_params.get("after"),
        _limit(request),
    )
    return _page([file_object(r) for r in rows], more)


def _file(request: HTTPRequest, file_id: str) -> FileRow:
    store, _ = _store(request)
    row = store.get_file(file_id, owner_of(request))
    if row is None:
        raise _not_found("file", file_id, "file_id")
    return row


async def get_file(request: HTTPRequest, file_id: str) -> Response:
    return JSONResponse(file_object(_file(request, file_id)))


async def file_content(request: HTTPRequest, file_id: str) -> Response:
    row = _file(request, file_id)
    return FileResponse(row.path, media_type="application/jsonl", filename=row.filename)


async def delete_file(request: HTTPRequest, file_id: str) -> Response:
    store, _ = _store(request)
    try:
        deleted = store.delete_file(file_id, owner_of(request))
    except FileInUse as exc:
        raise APIError(
            409,
            f"file {file_id} is the input of batch {exc.batch_id}, which is still running; "
            "cancel the batch or wait for it to end first",
            param="file_id",
            code="file_in_use",
        ) from None
    if not deleted:
        raise _not_found("file", file_id, "file_id")
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


# -- batches ---------------------------------------------------------------------------------------


async def create_batch(request: HTTPRequest) -> Response:
    store, settings = _store(request)
    body = parse_body(await request.body())
    owner = owner_of(request)
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str):
        raise bad_request("input_file_id is required", "input_file_id")
    row = store.get_file(file_id, owner)
    if row is None:
        raise _not_found("file", file_id, "input_file_id")
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise bad_request(f"endpoint must be one of {', '.join(ENDPOINTS)}", "endpoint")
    window = body.get("completion_window")
    match = _WINDOW.match(window) if isinstance(window, str) else None
    if match is None or not isinstance(window, str):
        raise bad_request("completion_window must look like '24h'", "completion_window")
    window_s = int(match[1]) * (3600 if match[2] == "h" else 60)
    if not 60 <= window_s <= settings.max_completion_window_s:
        raise bad_request(
            f"completion_window must be between 1m and {settings.max_completion_window_s} s",
            "completion_window",
        )
    metadata = body.get("metadata")
    if metadata is not None and (
        not isinstance(metadata, dict)
        or len(metadata) > 16
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise bad_request("metadata must map at most 16 strings to strings", "metadata")
    total = _count_lines(row)
    batch = store.add_batch(owner, file_id, endpoint, window, window_s, total, metadata)
    return JSONResponse(batch_object(batch))


def _count_lines(row: FileRow) -> int:
    """Non-empty lines; refuses a file that repeats a custom_id (results are keyed by it)."""
    seen: set[str] = set()
    total = 0
    with open(row.path, "rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            total += 1
            try:
                custom_id = json.loads(raw).get("custom_id")
            except (ValueError, AttributeError, UnicodeDecodeError):
                continue  # an unusable line: an error-file entry when it runs
            if not isinstance(custom_id, str):
                continue
            if custom_id in seen:
                raise bad_request(
                    f"line {number} repeats custom_id {custom_id!r}: each must be unique",
                    "input_file_id",
                )
            seen.add(custom_id)
    if total == 0:
        raise bad_request("the input file has no lines", "input_file_id")
    return total


async def list_batches(request: HTTPRequest) -> Response:
    store, _ = _store(request)
    rows, more = store.list_batches(
        owner_of(request), request.query_params.get("after"), _limit(request)
    )
    return _page([batch_object(r) for r in rows], more)


def _batch(request: HTTPRequest, batch_id: str) -> BatchRow:
    store, _ = _store(request)
    row = store.get_batch(batch_id, owner_of(request))
    if row is None:
        raise _not_found("batch", batch_id, "batch_id")
    return row


async def get_batch(request: HTTPRequest, batch_id: str) -> Response:
    return JSONResponse(batch_object(_batch(request, batch_id)))


async def cancel_batch(request: HTTPRequest, batch_id: str) -> Response:
    store, _ = _store(request)
    row = _batch(request, batch_id)
    if row.status in FINAL:
        raise APIError(
            409, f"batch {batch_id} is {row.status} and cannot be cancelled", param="batch_id"
        )
    store.set_status(batch_id, "cancelling", only_from=("validating", "in_progress"))
    return JSONResponse(batch_object(_batch(request, batch_id)))
