"""The API's front process: it owns the public address, answers the polled reads from its own cache,
holds a queued Tinker call's repeat polls and passes every other request to the coordinator (reads never stall training).

May import: nothing of the product but its own modules.
"""
