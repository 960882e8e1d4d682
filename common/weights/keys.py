"""The Redis key names of the weight store; all keys of one run share ``weights:{run_id}:``."""

from __future__ import annotations


def weights_chunk_key(run_id: str, version: int, index: int) -> str:
    """One chunk of the safetensors bytes of ``version``."""
    return f"weights:{run_id}:{version}:chunk:{index}"


def weights_manifest_key(run_id: str, version: int) -> str:
    """JSON manifest of ``version`` (tensor names, shapes, dtypes, chunk sha256s); written last."""
    return f"weights:{run_id}:{version}:manifest"


def weights_latest_key(run_id: str) -> str:
    """The newest complete version number; moved only after its manifest exists."""
    return f"weights:{run_id}:latest"


def weights_versions_key(run_id: str) -> str:
    """Sorted set of complete versions (score = version), used for retention."""
    return f"weights:{run_id}:versions"


def weights_channel(run_id: str) -> str:
    """Pub/sub channel on which a new version number is announced."""
    return f"weights:{run_id}:announce"


def weights_bytes_key(run_id: str, version: int) -> str:
    """JSON of how ``version``'s bytes are stored in Redis (kind, delta base and encoding, chunk
    sha256s), for a version committed before its bytes (the node-local plane, docs/design.md
    §6.5); set, in one script, once those chunks are all there."""
    return f"weights:{run_id}:{version}:bytes"


def weights_nodes_key(run_id: str) -> str:
    """Hash: the node id of each host cache whose actors read this run -> the last time one of
    them fetched (unix seconds); the learner writes into its own node's cache while it is
    listed there."""
    return f"weights:{run_id}:nodes"
