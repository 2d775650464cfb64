"""Node-to-node logical replication: the wire protocol, the receiving endpoint with its conflict
resolver, and the sending client the ``replication`` consumer drives (DESIGN §7)."""
