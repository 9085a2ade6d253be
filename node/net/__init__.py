"""The network side of the node: hivemind's DHT, authorizer and identities, the rounds' own
protocol and data plane, the satellites' deposits and the state downloads. Decisions they take are in `islands.protocols` (pure); these
modules carry them out over the wire."""
