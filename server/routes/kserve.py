"""KServe v2 / Open Inference Protocol: health, model metadata and readiness, and infer with a BYTES
input of texts returning an FP32 [n, dim] output."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ValidationError

from server.deps import ServiceDep
from server.errors import BadRequest, NotFound, Unavailable, Unprocessable
from server.responses import EmbeddingResponse, OrjsonRoute

router = APIRouter(prefix="/v2", tags=["kserve-v2"], route_class=OrjsonRoute)

INPUT_NAME, OUTPUT_NAME = "text", "embedding"


class TensorInput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any]


class RequestedOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class InferenceRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[TensorInput]
    outputs: list[RequestedOutput] | None = None


def _model(service, name: str) -> None:
    if name != service.model_name:
        raise NotFound(f"model {name!r} is not served here; this server serves {service.model_name!r}")


@router.get("/health/live")
async def live() -> dict:
    return {"live": True}


@router.get("/health/ready")
async def ready(service: ServiceDep) -> dict:
    if not service.ready or service.draining:
        raise Unavailable("draining" if service.draining else "not ready")
    return {"ready": True}


@router.get("/models/{name}")
async def metadata(name: str, service: ServiceDep) -> dict:
    _model(service, name)
    return {
        "name": service.model_name, "versions": ["1"], "platform": "pytorch",
        "inputs": [{"name": INPUT_NAME, "datatype": "BYTES", "shape": [-1]}],
        "outputs": [{"name": OUTPUT_NAME, "datatype": "FP32", "shape": [-1, service.dim]}],
    }


@router.get("/models/{name}/ready")
async def model_ready(name: str, service: ServiceDep) -> dict:
    _model(service, name)
    if not service.ready or service.draining:
        raise Unavailable("draining" if service.draining else "not ready")
    return {"name": name, "ready": True}


def _flatten(data: list[Any]) -> list[Any]:
    out: list[Any] = []
    for x in data:
        out.extend(_flatten(x) if isinstance(x, list) else [x])
    return out


def _inlined_schema(model: type[BaseModel]) -> dict:
    """The model's JSON schema with its $defs inlined (an OpenAPI requestBody cannot reach local $defs)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)


@router.post("/models/{name}/infer", openapi_extra={"requestBody": {"required": True, "content": {
    "application/json": {"schema": _inlined_schema(InferenceRequest)}}}})
async def infer(name: str, service: ServiceDep, request: Request) -> EmbeddingResponse:
    # Parsed by hand: Open Inference Protocol clients do not all send a JSON content type.
    _model(service, name)
    try:
        body = InferenceRequest.model_validate_json(await request.body())
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
        raise Unprocessable(problems) from None
    if len(body.inputs) != 1 or body.inputs[0].name != INPUT_NAME or body.inputs[0].datatype != "BYTES":
        raise BadRequest(f"expected exactly one BYTES input named {INPUT_NAME!r}")
    tensor = body.inputs[0]
    texts = _flatten(tensor.data)
    if not all(isinstance(t, str) for t in texts):
        raise BadRequest("BYTES input data must be strings")
    count = 1
    for d in tensor.shape:
        count *= d
    if count != len(texts):
        raise BadRequest(f"shape {tensor.shape} does not match {len(texts)} data elements")
    if body.outputs and any(o.name != OUTPUT_NAME for o in body.outputs):
        raise BadRequest(f"the only output is {OUTPUT_NAME!r}")
    normalize = bool((body.parameters or {}).get("normalize", True))
    result = await service.embed_texts(texts, normalize=normalize, truncate=True, request=request)
    response = {
        "model_name": service.model_name, "model_version": "1",
        "outputs": [{"name": OUTPUT_NAME, "datatype": "FP32", "shape": [len(texts), service.dim],
                     "data": result.embeddings.ravel()}],
    }
    if body.id is not None:
        response["id"] = body.id
    return EmbeddingResponse(response)
