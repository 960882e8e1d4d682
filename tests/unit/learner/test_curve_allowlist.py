"""CurveZMQ with an allow-list: only listed actor keys get a group through; refusals counted."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

from common.curve_keys import CurveKeys, actor_keys, authorized_dir, learner_keys
from common.link.send.sender import GroupSender
from ops.cli import main as cli_main
from ops.keys import write_keys
from testing.transport import drain, make_group, start_receiver, wait_until

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    assert cli_main(["keys", str(tmp_path), "--actor", "alice", "--actor", "bob"]) == 0
    return tmp_path


def test_keys_layout_and_idempotence(keys: Path) -> None:
    names = {p.name for p in keys.iterdir()}
    assert {"learner.key", "learner.key_secret", "alice.key_secret", "bob.key"} <= names
    assert {p.name for p in authorized_dir(keys).iterdir()} == {"alice.key", "bob.key"}
    assert (keys / "alice.key_secret").stat().st_mode & 0o077 == 0
    learner_public = learner_keys(keys).public
    # Adding an actor later keeps the learner's pair (actors already trust its public key).
    assert write_keys(keys, ("carol",))
    assert learner_keys(keys).public == learner_public
    assert actor_keys(keys, "carol").server_public == learner_public
    with pytest.raises(ValueError):
        write_keys(keys, ("../evil",))


def test_only_listed_keys_get_through_and_refusals_are_counted(
    keys: Path, caplog: pytest.LogCaptureFixture
) -> None:
    receiver = start_receiver(curve=learner_keys(keys), authorized_keys=authorized_dir(keys))
    stranger_public, stranger_secret = zmq.curve_keypair()
    stranger = CurveKeys(stranger_public, stranger_secret, learner_keys(keys).public)
    wrong_server_public, _ = zmq.curve_keypair()
    wrong_server = CurveKeys(*zmq.curve_keypair(), wrong_server_public)
    intruders = [
        GroupSender(receiver.bound_address, "stranger", curve=stranger).start(),
        GroupSender(receiver.bound_address, "wrong-server", curve=wrong_server).start(),
        GroupSender(receiver.bound_address, "plain").start(),  # no CURVE at all
    ]
    try:
        for sender in intruders:
            sender.submit(make_group(9))
        with GroupSender(receiver.bound_address, "alice", curve=actor_keys(keys, "alice")) as ok:
            ok.submit(make_group(1))
            assert ok.flush(10.0)
        wait_until(lambda: receiver.intake.unauthenticated >= 3, timeout_s=10.0)
        assert [g.actor_id for g in drain(receiver, 1)] == ["alice"]
        assert receiver.intake.get(timeout_s=0.5) is None  # nothing from the intruders
        assert all(sender.unacked() == 1 for sender in intruders)
        assert receiver.intake.stats()["receiver/unauthenticated"] >= 3
        assert "refused CURVE client key" in caplog.text
        assert set(receiver.intake.live_actors()) == {"alice"}
    finally:
        for sender in intruders:
            sender.close(timeout_s=0.0)
        receiver.close()


def test_revoking_a_key_is_deleting_its_file(keys: Path) -> None:
    receiver = start_receiver(curve=learner_keys(keys), authorized_keys=authorized_dir(keys))
    try:
        (authorized_dir(keys) / "bob.key").unlink()
        with GroupSender(receiver.bound_address, "bob", curve=actor_keys(keys, "bob")) as bob:
            bob.submit(make_group(1))
            assert not bob.flush(2.0)
        assert receiver.intake.unauthenticated >= 1
    finally:
        receiver.close()


def test_allow_list_needs_curve_and_an_existing_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        start_receiver(authorized_keys=tmp_path)
    with pytest.raises(FileNotFoundError):
        start_receiver(curve=CurveKeys(*zmq.curve_keypair()), authorized_keys=tmp_path / "no")
