"""A prefill node's table of decode peers: control identities, their data-plane agents.

A decode node introduces each control connection (a ZMQ identity) with `PeerHello`; the
prefill node loads its data-plane metadata once per agent (`DataPlane.add_peer`) and maps
the identity to the agent. The table is bounded by liveness, not by a count that only
grows:

* one identity per agent: a decode node that reconnects (a new DEALER after an idle
  close, or a fence) says hello under a new identity, which replaces the old one (the old
  one's transfers in flight keep it only for their replies);
* an identity not heard from for `PEER_IDLE_S` (the pump's `last_heard`) with no transfer
  of its own is forgotten, and an agent left with no identity and no transfer is removed
  from the data plane;
* at most `MAX_DECODE_PEERS` agents at once (each costs NIXL state); beyond, a hello is
  refused (a stale peer's expiry makes room).

A refused identity (bad layout, failed warm-up, over the cap) has its orders rejected
with the reason until it says hello again; refusals expire with the identity too.
"""

from __future__ import annotations

import logging

import msgspec

from pdserve.kv_transfer.transfer_types import PeerMetadata

logger = logging.getLogger(__name__)

MAX_DECODE_PEERS = 256  # data-plane peers this node loads (each costs NIXL state)
MAX_REFUSED = 100_000  # refused identities remembered (beyond: their orders need a hello)
PEER_IDLE_S = 120.0  # twice a decode node's idle close: its connection is gone by then


def peer_name(metadata: bytes) -> str:
    """The agent name a `PeerHello`'s metadata gives (raises on malformed bytes)."""
    return msgspec.msgpack.decode(metadata, type=PeerMetadata).agent_name


class DecodePeers:
    def __init__(self, data, control):
        """`data`: a callable giving the data plane (built late); `control`: the
        `PrefillControl` (its `last_heard` and `forget`)."""
        self._data = data
        self.control = control
        self.agents: dict[bytes, str] = {}  # control identity -> its data-plane agent
        self.epochs: dict[str, int] = {}  # agent -> the epoch of its metadata loaded
        self.hello_epochs: dict[bytes, int] = {}  # control identity -> its hello's epoch
        self.refused: dict[bytes, str] = {}  # control identity -> why it is refused

    def hello(self, ident: bytes, metadata: bytes, busy: set[bytes], epoch: int = 0) -> None:
        """`busy`: identities that own transfers (a replaced one is kept for those)."""
        data = self._data()
        loaded, known = set(data.peers), set(self.agents.values())
        if len(self.hello_epochs) < MAX_REFUSED or ident in self.hello_epochs:
            self.hello_epochs[ident] = epoch  # its orders WRITE only to that epoch's agent
        try:
            name = peer_name(metadata)
            if epoch < self.epochs.get(name, epoch):  # a stale hello (an older link's)
                logger.info(
                    "ignoring a hello of %s's epoch %d (at %d)", name, epoch, self.epochs[name]
                )
                return
            name = data.add_peer(metadata)  # same bytes again: a no-op
        except Exception as e:  # a bad peer is refused, never trusted
            logger.warning("refusing a decode peer: %s", e)
            self.refuse(ident, f"peer refused: {e}")
            return
        if name not in known and len(known) >= MAX_DECODE_PEERS:
            logger.warning("refusing a decode peer: already %d", MAX_DECODE_PEERS)
            if name not in loaded:
                data.remove_peer(name)
            self.refuse(ident, f"peer refused: this node takes {MAX_DECODE_PEERS} peers")
            return
        for old, agent in list(self.agents.items()):  # its earlier connection is gone
            if agent == name and old != ident:
                del self.agents[old]
                if old not in busy:
                    self.control.forget(old)
        self.refused.pop(ident, None)
        self.agents[ident] = name
        self.epochs[name] = epoch
        logger.info("decode peer %s introduced itself", name)

    def failed(self, agent: str, problem: str) -> None:
        """A peer's data plane failed (its warm-up): drop it (its WRITEs in flight fail,
        so those attempts end) and refuse its orders until it says hello again."""
        for ident, name in list(self.agents.items()):
            if name == agent:
                del self.agents[ident]
                self.refuse(ident, f"peer refused: {problem}")
        self._data().remove_peer(agent)
        self.epochs.pop(agent, None)

    def refuse(self, ident: bytes, reason: str) -> None:
        if len(self.refused) < MAX_REFUSED:
            self.refused[ident] = reason

    def expire(self, now: float, busy: set[bytes], busy_agents: set[str]) -> None:
        """Forget identities silent for `PEER_IDLE_S` that own no transfer (`busy`), and
        data-plane peers no identity and no transfer (`busy_agents`) uses."""
        heard = self.control.last_heard
        for ident in list(heard):
            if ident not in busy and now - heard.get(ident, now) > PEER_IDLE_S:
                self.agents.pop(ident, None)
                self.refused.pop(ident, None)
                self.control.forget(ident)
        for ident in [i for i in self.refused if i not in heard]:
            del self.refused[ident]
        for ident in [i for i in self.hello_epochs if i not in heard and i not in busy]:
            del self.hello_epochs[ident]
        data = self._data()
        for agent in data.peers:
            if not self._in_use(agent, busy_agents):
                logger.info("forgetting decode peer %s (no connection, no transfer)", agent)
                data.remove_peer(agent)
                self.epochs.pop(agent, None)

    def _in_use(self, agent: str, busy_agents: set[str]) -> bool:
        return agent in busy_agents or agent in self.agents.values()
