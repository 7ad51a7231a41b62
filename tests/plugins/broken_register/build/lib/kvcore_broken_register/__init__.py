"""Test fixture: a plugin whose registration hook raises."""

import kvcore


@kvcore.hookimpl
def kvcore_register_backends(register):
    register("BROKEN_EARLY", "kvcore_broken_register:Nothing")
    raise RuntimeError("acme driver handshake failed")
