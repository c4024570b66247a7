"""The router's HTTP face: the aiohttp application and command line, its routes,
and config reloads.

The top layer: it may import every other router layer; nothing imports it.
"""
