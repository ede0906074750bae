"""The OpenAI API without HTTP, shared by the HTTP routes (`app/openai_server.py`) and batch
jobs. Nothing here imports Starlette or FastAPI (a test checks it).

    body.py         raw bytes → JSON object; depth and Unicode checks on any body dict
    prepare.py      OpenAILayer.prepare(route, body, headers=, request_id=) → GenerationJob
    complete.py     complete(job) → the non-streamed response dict
    errors.py       APIError (status + OpenAI error object), to_api_error
    unsupported.py  fields not implemented yet, refused unless at their no-op default
    prompts.py      bounded tokenization off the event loop
    schemas.py, chat.py, render.py, logprobs.py   request models, chat template, rendering
"""
