"""What touches paddle and other ranks: the protocol and its collectives, the wire framing,
the exchange of bytes, placements, device copies, paddle's AOA engine. Imports ``io``,
``format``, ``core`` and ``errors``."""
