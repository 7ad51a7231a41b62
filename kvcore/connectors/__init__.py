"""KV connectors (see kvcore.connectors.base)."""
