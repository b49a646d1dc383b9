"""``offloadd demo``: a private daemon and two ranks, end to end (it uses both sides, so it
lives with the side that imports the daemon's launcher).

Imports everything else; nothing imports it.
"""
