"""The collective weights path's pure parts: the wire layout, packing, buckets and the checks a
receiver makes against the collective manifest (the group itself:
tests/integration/test_weights_group.py)."""

from __future__ import annotations

import copy
import json
import threading

import psutil
import pytest
import torch
import torch.distributed as dist

import common.weights.collective as wc
import common.weights.group_join as gj
from common.config.actor import ActorConfig
from common.config.learner import LearnerConfig
from common.weights.format import WeightsCorrupt, WeightsError, WeightsNonFinite
from common.weights.manifest import digest_of_digests
from ops.redis_server import find_free_port


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(7, 13, generator=g),
        "b": torch.randn(5, generator=g, dtype=torch.float64),
        "half": torch.randn(3, 3, generator=g).to(torch.float16),
        "step": torch.tensor(41),
        "ids": torch.arange(9, dtype=torch.int32),
        "empty": torch.zeros(0, 4),
    }


def payload_of(s, bucket_bytes=128):
    layout = wc.wire_layout(s, bucket_bytes)
    payload = wc.pack(s, layout, torch.device("cpu"))
    digests = [
        wc.bucket_sha256(payload[a:b]) for a, b in wc.bucket_ranges(payload.numel(), bucket_bytes)
    ]
    return layout, payload, digests


def test_pack_then_views_give_the_state_in_the_wire_dtype():
    s = state()
    layout, payload, _ = payload_of(s)
    got = wc.views(payload, wc.slots(layout))
    assert list(got) == list(s)
    for name, t in s.items():
        want = t.to(wc.WIRE_DTYPE) if t.is_floating_point() else t
        assert got[name].dtype == want.dtype and got[name].shape == want.shape
        assert torch.equal(got[name], want), name
    entries = wc.slots(layout)
    assert all(e.offset % 64 == 0 for e in entries)
    # The padding between tensors is zero, so the digests depend on the tensors alone.
    covered = torch.zeros(payload.numel(), dtype=torch.bool)
    for e in entries:
        covered[e.offset : e.offset + e.nbytes] = True
    assert int(payload[~covered].sum()) == 0
    assert layout["total_bytes"] == payload.numel()


def test_a_dtype_the_wire_cannot_carry_is_refused():
    with pytest.raises(WeightsError, match="cannot travel"):
        wc.wire_layout({"c": torch.zeros(2, dtype=torch.complex64)})


def test_buckets_cover_the_payload_once():
    assert wc.bucket_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert wc.bucket_ranges(8, 4) == [(0, 4), (4, 8)]
    assert wc.bucket_ranges(0, 4) == []
    with pytest.raises(ValueError, match="bucket_bytes"):
        wc.wire_layout(state(), 32)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda t: t["w"].update(dtype="complex32"), "does not fit"),
        (lambda t: t["w"].update(nbytes=t["w"]["nbytes"] + 2), "does not fit"),
        (lambda t: t["b"].update(offset=t["w"]["offset"]), "does not fit"),
        (lambda t: t["b"].update(offset=t["b"]["offset"] + 2), "does not fit"),
        (lambda t: t["w"].update(shape=[-7, -13]), "does not fit"),
        (lambda t: t["ids"].pop("offset"), "malformed"),
    ],
)
def test_a_layout_that_does_not_fit_is_refused(change, match):
    layout = wc.wire_layout(state())
    change(layout["tensors"])
    with pytest.raises(WeightsCorrupt, match=match):
        wc.slots(layout)


def test_a_layout_past_the_payload_end_is_refused():
    layout = wc.wire_layout(state())
    layout["total_bytes"] -= 64
    with pytest.raises(WeightsCorrupt, match="does not fit"):
        wc.slots(layout)


def test_received_bytes_are_checked_against_the_manifest():
    layout, payload, digests = payload_of(state())
    assert len(digests) > 1
    manifest = wc.new_manifest("run", 3, layout, digests)
    wc.check_received("run", 3, copy.deepcopy(layout), digests, manifest)

    flipped = payload.clone()
    flipped[-1] ^= 1
    bad = [wc.bucket_sha256(flipped[a:b]) for a, b in wc.bucket_ranges(flipped.numel(), 128)]
    with pytest.raises(WeightsCorrupt, match=f"bucket {len(digests) - 1} hashes"):
        wc.check_received("run", 3, layout, bad, manifest)
    with pytest.raises(WeightsCorrupt, match="run 'run' version 3"):
        wc.check_received("other", 3, layout, digests, manifest)
    with pytest.raises(WeightsCorrupt, match="version 3"):
        wc.check_received("run", 4, layout, digests, manifest)
    other = wc.wire_layout({**state(), "w": torch.zeros(13, 7)}, 128)
    with pytest.raises(WeightsCorrupt, match="tensors differs"):
        wc.check_received("run", 3, other, digests, manifest)
    listed = {**manifest, "bucket_sha256": list(reversed(digests))}
    with pytest.raises(WeightsCorrupt, match="bucket list is damaged"):
        wc.check_received("run", 3, layout, digests, listed)
    relisted = {**listed, "buckets_sha256": digest_of_digests(listed["bucket_sha256"])}
    with pytest.raises(WeightsCorrupt, match="bucket 0 hashes"):
        wc.check_received("run", 3, layout, digests, relisted)
    refused = {"format": 1, "run_id": "run", "version": 3, "refused": "tensor w has 1 NaN"}
    with pytest.raises(WeightsNonFinite, match="1 NaN"):
        wc.check_received("run", 3, layout, digests, refused)
    with pytest.raises(WeightsError, match="no collective manifest"):
        wc.check_received("run", 3, layout, digests, None)
    with pytest.raises(WeightsError, match="format"):
        wc.check_received("run", 3, layout, digests, {**manifest, "format": 99})


def test_addresses_are_checked():
    assert wc.parse_address("127.0.0.1:29650") == ("127.0.0.1", 29650)
    assert wc.parse_address("[::1]:80") == ("::1", 80)
    for bad in ("127.0.0.1", ":80", "host:0", "host:port", "host:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            wc.parse_address(bad)


def listening(port: int) -> set[str]:
    """The local addresses this process listens on at ``port``."""
    return {
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


def test_a_host_that_is_not_loopback_is_refused_unless_allowed():
    port = find_free_port()
    for host in ("10.1.2.3", "0.0.0.0", "example.org"):
        with pytest.raises(wc.CollectiveError, match="not a loopback host"):
            wc.store_server(f"{host}:{port}", 5.0)
        with pytest.raises(ValueError, match="weights_group_allow_remote"):
            LearnerConfig(weights_group=True, weights_group_address=f"{host}:{port}")
    assert listening(port) == set()  # nothing was opened
    for host in ("127.0.0.1", "localhost", "[::1]"):
        LearnerConfig(weights_group=True, weights_group_address=f"{host}:{port}")
    LearnerConfig(
        weights_group=True, weights_group_address="10.1.2.3:1", weights_group_allow_remote=True
    )
    store = wc.store_server(f"localhost:{port}", 5.0)
    assert listening(port) and listening(port) <= {"127.0.0.1", "::1"}
    del store
    # Allowed explicitly, it listens where it is told, every interface included.
    store = wc.store_server(f"0.0.0.0:{port}", 5.0, allow_remote=True)
    assert listening(port) == {"0.0.0.0"}
    del store


def test_the_nccl_path_is_refused_until_a_gpu_has_run_it():
    with pytest.raises(wc.CollectiveError, match="not been run on a GPU"):
        wc.check_device(torch.device("cuda"))
    wc.check_device(torch.device("cpu"))
    with pytest.raises(ValueError, match="not been run on a GPU"):
        ActorConfig(weights_group=True, device="cuda:0")
    ActorConfig(weights_group=False, device="cuda:0")


def test_join_proofs_are_bound_to_the_secret_the_ticket_and_the_joiners_nonce():
    secret = gj.new_secret()
    nonce, proof = gj.new_join_proof(secret, "run", 3)
    assert gj.proven_nonce(secret, "run", 3, proof.encode()) == nonce
    assert gj.new_join_proof(secret, "run", 3)[0] != nonce  # a fresh nonce per joiner
    assert gj.proven_nonce(secret, "run", 4, proof) is None  # another ticket
    assert gj.proven_nonce(secret, "other", 3, proof) is None  # another run
    assert gj.proven_nonce(gj.new_secret(), "run", 3, proof) is None  # another secret
    other = "0" * 32
    assert gj.proven_nonce(secret, "run", 3, other + proof[32:]) is None  # another nonce
    assert gj.proven_nonce(secret, "run", 3, None) is None


def test_answers_are_signed_for_the_joiners_ticket_and_nonce():
    secret = gj.new_secret()
    nonce, _ = gj.new_join_proof(secret, "run", 3)
    answer = {"epoch": 2, "rank": 1, "size": 2}
    signed = gj.signed_answer(secret, "run", 3, nonce, answer)
    assert gj.verified_answer(secret, "run", 3, nonce, signed.encode()) == answer
    assert gj.verified_answer(secret, "run", 4, nonce, signed) is None  # another ticket
    assert gj.verified_answer(secret, "run", 3, "1" * 32, signed) is None  # another joiner
    assert gj.verified_answer(gj.new_secret(), "run", 3, nonce, signed) is None
    forged = signed.replace('\\"epoch\\": 2', '\\"epoch\\": 99')
    assert forged != signed and gj.verified_answer(secret, "run", 3, nonce, forged) is None
    for unsigned in (json.dumps(answer), json.dumps({"refused": "x"}), "not json", None):
        assert gj.verified_answer(secret, "run", 3, nonce, unsigned) is None


def form_and_authenticate(secrets: list[str]) -> list[BaseException | None]:
    """Ranks 0..n-1 of one gloo group in threads, each proving its own ``secrets[rank]``;
    what each raised."""
    port = find_free_port()
    store = wc.store_server(f"127.0.0.1:{port}", 20.0)
    outcome: list[BaseException | None] = [None] * len(secrets)

    def rank_main(rank: int) -> None:
        client = store if rank == 0 else dist.TCPStore("127.0.0.1", port, is_master=False)
        try:
            group = wc.WeightsGroup(client, 1, rank, len(secrets), torch.device("cpu"), 20.0)
            group.authenticate(secrets[rank], "run", 20.0)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            outcome[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(secrets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outcome


def test_every_rank_of_an_epoch_proves_the_secret_over_the_group():
    secret = gj.new_secret()
    assert form_and_authenticate([secret, secret, secret]) == [None, None, None]
    outcome = form_and_authenticate([secret, secret, gj.new_secret()])
    assert all(isinstance(e, wc.CollectiveError) for e in outcome), outcome
    # The proper ranks find rank 2 out; rank 2 finds that the others do not share its secret.
    assert all("rank(s) [2] do not know the run's secret" in str(e) for e in outcome[:2])
    assert "rank(s) [0, 1] do not know" in str(outcome[2])
