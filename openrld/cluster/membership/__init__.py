"""Cluster membership: SWIM failure detection with Lifeguard refinements, gossip, and push-pull.

One idea per module, with no I/O below `node.py`: `config` (parameters and the
detection bound), `messages`, `codec` (msgpack + cluster-secret tag), `table`
(incarnation rules), `suspicion`, `awareness`, `broadcasts`, `transport` (UDP)
and `fake_network` (in-memory, for the fake clock), `node` (the actor),
`peer_client` (push-pull over HTTP), `service` (the daemon's wiring) and
`simulation` (whole clusters for tests and benchmarks).

What other code reads: `MembershipNode.members()`/`member(name)`/`live_members()`
return `table.Member` (name, addr, incarnation, state, payload, peer_url);
`MembershipNode.set_payload(NodePayload)` publishes this node's resources.
"""
