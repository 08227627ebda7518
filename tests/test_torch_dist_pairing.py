"""torch_dist pairing that nothing outside it can wedge (kv_transfer/transports/torch_dist*.py).

The decode worker's store is plaintext and reachable by whatever reaches `transfer.host`; a
sender draws a pair number from a counter there, then registers it. These tests play the
outsider (a store client of their own, or a sender process killed between drawing and
registering) and check that legitimate senders still pair and transfer bit for bit, within a
bound well under the transfer timeout, that the store listens on the configured host only,
and that with a secret a wrong sender is refused before any group exists.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_procs

from engine.block_manager import BlockManager
from kv_transfer.receiver import KVReceiver, ReservationState
from kv_transfer.sender import KVSender
from kv_transfer.transports.base import get_transport
from kv_transfer.transports.torch_dist import TorchDistEndpoint
from kv_transfer.transports.torch_dist_pairing import (
    NEXT_PAIR,
    PAIR_EXPIRED,
    claim_pair,
    pair_key,
    td,
)
from kv_transfer.wire import TransferError, TransferUnauthenticated
from protos.pdserve.v1 import kv_transfer_pb2 as pb

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"
TIMEOUT_S = 10.0  # the transfer timeout (TransferConfig's default)
BOUND_S = 3.0  # a legitimate pair after an outsider's meddling: well under TIMEOUT_S
SHORT_S = 1.0  # the timeout where a test waits for a drawn number to expire
SECRET = "pairing-secret-0123456789abcdef"
WRONG_SECRET = "another-secret-0123456789abcdef"
SRC_SEED = 4242


class Rx:
    """A receiving cache (sentinel pattern) and a torch_dist endpoint over it."""

    def __init__(self, timeout_s: float = TIMEOUT_S, secret: str | None = None) -> None:
        self.cache = kv_procs.make_cache("float32", 64)
        kv_procs.fill(self.cache, 7)
        self.blocks = BlockManager(64, kv_procs.BLOCK_SIZE)
        self.receiver = KVReceiver(self.cache, self.blocks, transport="torch_dist")
        tr = get_transport("torch_dist", timeout_s, secret=secret)
        endpoint = tr.listen(self.receiver, HOST)
        assert isinstance(endpoint, TorchDistEndpoint)
        self.endpoint = endpoint
        self.receiver.address = endpoint.address
        self.port = int(endpoint.address.rsplit(":", 1)[1])
        self.senders: list[KVSender] = []

    def client(self) -> dist.TCPStore:
        """An outsider: a plain store client, as anything that reaches the port can open."""
        return dist.TCPStore(HOST, self.port, None, False, timeout=td(5.0))

    def sender(self, name: str, secret: str | None = None) -> KVSender:
        src = kv_procs.make_cache("float32", kv_procs.SRC_BLOCKS)
        kv_procs.fill(src, SRC_SEED)
        tr = get_transport("torch_dist", TIMEOUT_S, secret=secret)
        self.senders.append(s := KVSender(src, name, tr))
        return s

    def transfer(self, sender: KVSender, rid: str) -> float:
        """One whole transfer, checked bit for bit; its seconds, pairing included."""
        ticket = self.receiver.reserve(rid, 16 * 3 + 5)
        dst = list(ticket.dst_block_ids)
        src_ids = kv_procs.spread_ids(len(dst))
        t0 = time.monotonic()
        ack = sender.send(ticket, src_ids)
        elapsed = time.monotonic() - t0
        assert ack.status == pb.TRANSFER_STATUS_COMPLETE, ack
        got = self.cache.data[:, :, dst]
        assert kv_procs.same_bytes(got, kv_procs.source_pages("float32", SRC_SEED, src_ids))
        self.blocks.free(self.receiver.take(ticket.transfer_id).request_id)
        return elapsed

    def close(self) -> None:
        for s in self.senders:
            s.close()
        self.endpoint.close()


@pytest.fixture
def rx() -> Iterator[Rx]:
    r = Rx()
    yield r
    r.close()


def _wait_for(cond: Any, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _draw_and_die(port: int) -> None:
    """A sender process SIGKILLed between drawing its pair number and registering it."""
    code = (
        "import os, signal, datetime, torch.distributed as d\n"
        f"s = d.TCPStore({HOST!r}, {port}, None, False, timeout=datetime.timedelta(seconds=5))\n"
        f"s.add({NEXT_PAIR!r}, 1)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()


# ---- a drawn number nobody registers holds up nobody -----------------------------------------
@pytest.mark.parametrize("who", ["outsider_add", "sender_killed_after_add"])
def test_a_drawn_but_unregistered_number_holds_up_nobody(rx: Rx, who: str) -> None:
    """The number drawn first is never registered; the next sender still pairs at once (not
    after the 10 s a strictly ordered receiver waited, forever), and so does every later one."""
    if who == "outsider_add":
        outsider = rx.client()
        assert outsider.add(NEXT_PAIR, 1) == 1
    else:
        _draw_and_die(rx.port)
    assert rx.transfer(rx.sender("p0"), "r0") < BOUND_S
    assert rx.transfer(rx.sender("p1"), "r1") < BOUND_S
    assert rx.endpoint.num_pairs == 2 and rx.endpoint.broken_pairs == 0
    assert rx.endpoint.skipped_pairs == 0  # number 0 is still watched: its timeout is 10 s


def test_a_number_is_skipped_after_its_timeout_and_never_reused() -> None:
    """After `timeout_s` the unregistered number is marked expired: a registration racing in
    later cannot take it (the sender draws the next number), and pairing carries on."""
    rx = Rx(timeout_s=SHORT_S)
    try:
        outsider = rx.client()
        outsider.add(NEXT_PAIR, 1)
        assert _wait_for(lambda: rx.endpoint.skipped_pairs == 1, SHORT_S + 2.0)
        assert outsider.compare_set(pair_key(0), "", "late:p9") == PAIR_EXPIRED.encode()
        assert claim_pair(outsider, "p9") == 1  # drawn anew, never number 0
        assert _wait_for(lambda: rx.endpoint.num_pairs == 1, 2.0)  # served out of order
        assert rx.transfer(rx.sender("p0"), "r0") < BOUND_S
        assert rx.endpoint.num_pairs == 2 and rx.endpoint.skipped_pairs == 1
    finally:
        rx.close()


@pytest.mark.parametrize("how", ["garbage", "deleted", "set_back", "far_ahead", "ahead"])
def test_a_tampered_counter_is_put_back(rx: Rx, how: str) -> None:
    """Whatever an outsider does to the counter, the next sender pairs within the bound (a
    counter that is not a number would make c10d drop every client that adds to it)."""
    assert rx.transfer(rx.sender("p0"), "r0") < BOUND_S  # the counter is at 1
    outsider = rx.client()
    if how == "garbage":
        outsider.set(NEXT_PAIR, "not a number")
    elif how == "deleted":
        outsider.delete_key(NEXT_PAIR)
    elif how == "set_back":
        outsider.add(NEXT_PAIR, -5)
    elif how == "far_ahead":  # past any plausible burst: put back
        outsider.set(NEXT_PAIR, str(1 << 62))
    else:  # a burst: the receiver watches the newest numbers and skips the rest
        outsider.add(NEXT_PAIR, 1000)
    if how in ("garbage", "deleted", "set_back", "far_ahead"):
        assert _wait_for(lambda: outsider.get(NEXT_PAIR) == b"1", 2.0)
    assert rx.transfer(rx.sender("p1"), "r1") < BOUND_S
    assert rx.endpoint.num_pairs == 2 and rx.endpoint.broken_pairs == 0


def test_a_registration_taken_by_an_outsider_is_drawn_around(rx: Rx) -> None:
    """An outsider that registers the next number first does not get the sender's pair: the
    sender's compare-and-set fails and it draws another; the outsider's bogus pair waits in
    its challenge on a store connection of its own, holding up no other pair."""
    outsider = rx.client()
    outsider.set(pair_key(0), "garbage")  # number 0, registered before anyone drew it
    assert rx.transfer(rx.sender("p0"), "r0") < BOUND_S
    assert rx.endpoint.num_pairs == 2  # the bogus registration (in its challenge) and p0


# ---- the store listens on transfer.host only -------------------------------------------------
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="127.0.0.2 is loopback on Linux")
def test_the_store_listens_on_the_configured_host_only(rx: Rx) -> None:
    """c10d's server would listen on every interface; the endpoint's is bound to `host`."""
    ctl_port = rx.endpoint._listener.getsockname()[1]
    for port in (rx.port, ctl_port):
        socket.create_connection((HOST, port), timeout=2).close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", port), timeout=2)
    assert rx.transfer(rx.sender("p0"), "r0") < BOUND_S


# ---- with a secret: refused before any group, then the right sender pairs ---------------------
def _group_keys(store: dist.TCPStore, pair: int) -> list[str]:
    keys: list[str] = store.list_keys()
    return [k for k in keys if k.startswith(f"pg/{pair}/")]


def test_a_wrong_secret_is_refused_before_any_group_then_the_right_one_pairs() -> None:
    rx = Rx(secret=SECRET)
    try:
        outsider = rx.client()
        ticket = rx.receiver.reserve("r", 16 * 2)
        src_ids = kv_procs.spread_ids(len(ticket.dst_block_ids))
        before = rx.cache.data.clone()
        for i, secret in enumerate((WRONG_SECRET, None)):
            intruder = rx.sender(f"intruder-{i}", secret)
            t0 = time.monotonic()
            with pytest.raises(TransferUnauthenticated, match="authentication failed"):
                intruder.send(ticket, src_ids)
            assert time.monotonic() - t0 < BOUND_S
            assert rx.endpoint.refused_pairs == i + 1
            assert _group_keys(outsider, i) == []  # no rendezvous was ever started
        assert kv_procs.same_bytes(rx.cache.data, before)
        res = rx.receiver.get(ticket.transfer_id)
        assert res is not None and res.state is ReservationState.RESERVED and not res.received
        rx.receiver.fail(ticket.transfer_id, "test: the next transfer is checked whole")
        assert rx.transfer(rx.sender("p", SECRET), "r-ok") < BOUND_S
        assert _group_keys(outsider, 2) != []  # the authenticated pair did build its group
        assert rx.endpoint.refused_pairs == 2 and rx.endpoint.num_pairs == 3
    finally:
        rx.close()


def test_an_unanswered_challenge_holds_up_nobody_and_close_is_prompt() -> None:
    """A registration that never answers its challenge (an outsider's) waits out its own
    timeout; an authenticated sender pairs meanwhile, and closing does not wait for it."""
    rx = Rx(secret=SECRET)
    outsider = rx.client()
    claim_pair(outsider, "outsider")  # registered, never answers
    assert _wait_for(lambda: outsider.check(["auth/0/nonce"]), 2.0)
    assert rx.transfer(rx.sender("p", SECRET), "r") < BOUND_S
    assert rx.endpoint.refused_pairs == 0  # the outsider's challenge is still open
    t0 = time.monotonic()
    rx.close()
    assert time.monotonic() - t0 < BOUND_S
    assert rx.endpoint.refused_pairs == 1


def test_pairs_past_the_challenge_cap_are_turned_away_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations that never answer occupy at most `_MAX_AUTHENTICATING` challenges; one
    more is turned away at once with a TransferError (not an authentication failure), and a
    sender pairs again once a challenge slot is free."""
    import kv_transfer.transports.torch_dist as torch_dist

    monkeypatch.setattr(torch_dist, "_MAX_AUTHENTICATING", 1)
    rx = Rx(timeout_s=SHORT_S, secret=SECRET)
    try:
        claim_pair(rx.client(), "outsider")  # holds the only challenge slot for SHORT_S
        assert _wait_for(lambda: rx.endpoint.num_pairs == 1, 2.0)
        ticket = rx.receiver.reserve("busy", 16)
        with pytest.raises(TransferError, match="turned the pair away") as e:
            rx.sender("p0", SECRET).send(ticket, kv_procs.spread_ids(1))
        assert not isinstance(e.value, TransferUnauthenticated)
        assert rx.endpoint.busy_pairs == 1
        assert _wait_for(lambda: rx.endpoint.refused_pairs == 1, SHORT_S + 2.0)
        rx.receiver.fail(ticket.transfer_id, "test: the next transfer is checked whole")
        assert rx.transfer(rx.sender("p1", SECRET), "r") < BOUND_S
    finally:
        rx.close()
