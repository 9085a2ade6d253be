"""The network side of the node: hivemind's DHT, averagers, authorizer and identities, and the
satellites' deposit service. Decisions they take are in `islands.protocols` (pure); these
modules carry them out over the wire."""
