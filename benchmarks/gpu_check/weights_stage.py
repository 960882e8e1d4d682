"""Stage 2 of the GPU check: a bf16 weight publish and fetch through the weight format's own
functions, over an in-memory store."""

from __future__ import annotations

import copy
import json
import statistics
import time
from typing import Any

import torch

from benchmarks import cli
from benchmarks.gpu_check.plan import (
    Plan,
    Run,
    params_of,
    sync,
)
from common.model import Transformer
from common.model_args import with_tied_head, without_tied_head
from common.weights.format import (
    check_finite,
    dtype_name,
    serialize_state_dict,
    tensors_from_safetensors,
    weights_digest,
)
from common.weights.manifest import (
    MANIFEST_FORMAT,
    check_against_manifest,
    check_manifest,
    chunk_list,
    digest_of_digests,
    sha256_of,
)

# ------------------------------------------------------------------------------ weights


CHUNK_BYTES = 8 * 2**20  # redis.chunk_bytes' default
RUN_ID = "gpu-check"


def publish(
    model: Transformer, version: int, dtype: torch.dtype, store: dict[str, bytes]
) -> dict[str, float]:
    """``version`` of ``model`` in ``store`` as the learner writes one (a full version): the
    snapshot in the publish dtype on the host, the finite check and digest, safetensors bytes,
    ``CHUNK_BYTES`` chunks and their sha256, the manifest last; seconds of each part."""
    device = model.lm_head.weight.device
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        state = {
            name: t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype, copy=True)
            for name, t in without_tied_head(model.state_dict(), model.args).items()
        }
    t1 = time.perf_counter()
    check_finite(version, state)
    digest = weights_digest(state, threads=1)  # as WeightWriter.publish
    data = serialize_state_dict(state)
    t2 = time.perf_counter()
    view = memoryview(data)
    chunk_sha256 = []
    for index, start in enumerate(range(0, len(data), CHUNK_BYTES)):
        chunk = view[start : start + CHUNK_BYTES]
        chunk_sha256.append(sha256_of(chunk).hex())
        store[f"{RUN_ID}:{version}:chunk:{index}"] = bytes(chunk)
    floats = {dtype_name(t.dtype) for t in state.values() if t.is_floating_point()}
    manifest = {
        "format": MANIFEST_FORMAT,
        "run_id": RUN_ID,
        "version": version,
        "kind": "full",
        "keyframe": version,
        "weights_sha256": digest,
        "dtype": floats.pop() if len(floats) == 1 else "mixed",
        "tensors": {
            n: {"shape": list(t.shape), "dtype": dtype_name(t.dtype)} for n, t in state.items()
        },
        "num_chunks": len(chunk_sha256),
        "chunk_sha256": chunk_sha256,
        "chunks_sha256": digest_of_digests(chunk_sha256),
        "total_bytes": len(data),
    }
    store[f"{RUN_ID}:{version}:manifest"] = json.dumps(manifest).encode()
    t3 = time.perf_counter()
    return {
        "bytes": len(data),
        "snapshot_s": t1 - t0,
        "serialize_s": t2 - t1,
        "chunks_s": t3 - t2,
        "total_s": t3 - t0,
        "chunks": len(chunk_sha256),
    }


def fetch(
    target: Transformer, version: int, store: dict[str, bytes]
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """``version`` from ``store`` as an actor reads one: the manifest checked, each chunk
    checked against its sha256 as it lands in one buffer, tensors over that buffer checked
    against the manifest and for finiteness, then loaded into ``target`` on its device."""
    device = target.lm_head.weight.device
    t0 = time.perf_counter()
    manifest = check_manifest(RUN_ID, version, json.loads(store[f"{RUN_ID}:{version}:manifest"]))
    chunk_sha256, total_bytes = chunk_list(version, manifest)
    buf = torch.empty(total_bytes, dtype=torch.uint8)
    out, position = memoryview(buf.numpy()), 0
    for index, want in enumerate(chunk_sha256):
        chunk = store[f"{RUN_ID}:{version}:chunk:{index}"]
        landed = out[position : position + len(chunk)]
        landed[:] = chunk
        if sha256_of(landed).hex() != want:
            raise ValueError(f"version {version}: chunk {index} fails its sha256")
        position += len(chunk)
    if position != total_bytes:
        raise ValueError(f"version {version}: {position} bytes, the manifest says {total_bytes}")
    state = tensors_from_safetensors(version, buf)
    state = check_against_manifest(version, state, manifest["tensors"])
    check_finite(version, state)
    t1 = time.perf_counter()
    target.load_state_dict(with_tied_head(state, target.args), strict=True)
    sync(device)
    t2 = time.perf_counter()
    return {"read_s": t1 - t0, "load_s": t2 - t1, "total_s": t2 - t0}, state


def weight_sync(
    plan: Plan, device: torch.device, run: Run, source: Transformer | None
) -> dict[str, Any]:
    """``weight_rounds`` versions of ``source`` (the learner stage's model; a fresh one of its
    shape if that stage failed) published and fetched; medians."""
    if source is None:
        source = cli.random_model(device=device, **plan.learner_shape)
    dtype = torch.bfloat16
    target = copy.deepcopy(source).to(dtype)
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    pubs, fetches = [], []
    exact = True
    for version in range(1, plan.weight_rounds + 1):
        with torch.no_grad():  # a new version: every weight moves a little
            for p in source.parameters():
                p.mul_(1.0 + 1e-3)
        store: dict[str, bytes] = {}
        pub = publish(source, version, dtype, store)
        got, state = fetch(target, version, store)
        pubs.append(pub)
        fetches.append(got)
        run.say(
            "weights",
            f"v{version}: {pub['bytes'] / 1e6:.1f} MB, publish {pub['total_s']:.3f}s, "
            f"fetch {got['total_s']:.3f}s",
        )
        # Outside the timing: what the device holds now is bit for bit the source in bf16.
        reference = {n: t.detach().to(dtype) for n, t in source.state_dict().items()}
        exact &= all(torch.equal(t.to(device), reference[n]) for n, t in state.items())
        exact &= all(torch.equal(t, reference[n]) for n, t in target.state_dict().items())
        del store, state, reference
    size = pubs[0]["bytes"]

    def median(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    out = {
        "publish_store": "memory",
        "weights_params": params_of(source),
        "weights_dtype": dtype_name(dtype),
        "weights_bytes": size,
        "weights_chunks": pubs[0]["chunks"],
        "weights_chunk_bytes": CHUNK_BYTES,
        "weights_rounds": plan.weight_rounds,
        "weights_publish_s": round(median(pubs, "total_s"), 4),
        "weights_publish_gbps": round(size / median(pubs, "total_s") / 1e9, 3),
        "weights_publish_snapshot_s": round(median(pubs, "snapshot_s"), 4),
        "weights_publish_serialize_s": round(median(pubs, "serialize_s"), 4),
        "weights_publish_chunks_s": round(median(pubs, "chunks_s"), 4),
        "weights_fetch_s": round(median(fetches, "total_s"), 4),
        "weights_fetch_gbps": round(size / median(fetches, "total_s") / 1e9, 3),
        "weights_fetch_read_s": round(median(fetches, "read_s"), 4),
        "weights_fetch_load_s": round(median(fetches, "load_s"), 4),
        "weights_roundtrip_exact": bool(exact),
    }
    del source, target
    return out
